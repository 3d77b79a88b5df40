"""Node records: what a node tells the swarm about itself, and how it is checked.

A record (gossiped to and kept by every member, newest `seq` wins) says where
the node can be reached, its hardware, its assigned shard, whether its
doctor admitted it, the models it holds, spare capacity and the chat demand
it saw. Every member decodes every record, so the body is decoded strictly
and every known field bounded; unknown keys are ignored for rolling
upgrades. A bad record is a drop reason, never an exception. Validation
lives in `__post_init__`, so a node's own record passes its peers' checks.

More: docs/design/wire.md#node-records.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal, get_args

import cbor2

from mesh.fields import (
    MAX_UINT,
    FieldError,
    boolean,
    hex_text,
    is_uint,
    number,
    one_of,
    reraise_as,
    span,
    text,
    uint,
)
from mesh.identity import Signer, Verifier, node_id_text
from mesh.messages import Record, record_signing_bytes
from mesh.wire import REASON_BAD_FIELD, REASON_OVERSIZED, DecodeError, decode_strict_cbor

# --- limits -----------------------------------------------------------------

MAX_RECORD_BODY_BYTES = 16 * 1024
"""A realistic record (addresses, a capability report, a few models and demand
counters) encodes to about 1 KiB. Every member stores every record and a
push-pull sync carries all of them, so the cap bounds what one node can cost
the swarm: at 1,000 members a full state is at most 16 MB even if every node
were at the cap. The per-field limits below bound each field on its own; they
cannot all be at their maximum at once, and this cap bounds the sum."""

MAX_NOTICE_CHANGES = 16
"""Assignment changes a ledger notice names: a placement round changes a
handful, so 16 covers the last rounds between two gossip spreads, at
~80 bytes each in the leader's record."""

MAX_CBOR_DEPTH = 8
"""The schema nests three deep (record -> capability -> layers); eight leaves
room for fields added later while stopping pathological nesting early."""

MAX_MODEL_NAME_CHARS = 200
"""Model names are manifest names or directory names; 200 characters covers
Hugging Face's `org/name-with-variant` style with room to spare."""

MAX_MODELS = 64
"""Models a node may list as locally available. A machine rarely holds more
than a handful; 64 keeps a record within its size cap."""

MAX_DEMAND_ENTRIES = 64
"""Models a node may report demand for. Demand is per model the swarm knows,
and a single node's counters only need the models its users asked for."""

MAX_LAYER_INDEX = 10_000
"""Exclusive upper bound for a layer index. The deepest published models have
a few hundred layers; anything near 10,000 is an error or an attack, and
bounding it keeps per-layer arrays (replica counts) small."""

MAX_ADDRESS_CHARS = 300
"""An endpoint is a scheme, a host and a port: DNS names stop at 253
characters, plus `tcp://` and `:65535`."""

MAX_RELAYED = 4
"""Relays a record names a node reached through (`Addresses.relayed`): a
node behind NAT holds two (`mesh.relay.RELAYS_WANTED`); four leaves room
for a third while one is being replaced."""

MAX_DEVICE_CHARS = 64
"""Device descriptors are short (`cuda:0`, `mps`, `cpu`, `gpu`)."""

MAX_DIGEST_HEX_CHARS = 128
"""A manifest digest in lowercase hex: 64 for SHA-256, up to 128 for 512-bit
hashes, so the manifest can change hash without a record format change."""

MAX_RTT_PEERS = 16
"""Members a record gives its measured round trips to (`NodeRecord.rtt_us`).
Routes need the delay between consecutive hops, which only the hops
measure; a node publishes its nearest 16 (a chain's neighbours are near
ones), about 1.1 KiB. A pair without a figure falls back to the entry's own
estimate (`mesh.routes.one_way_s`)."""

MAX_RTT_US = 60_000_000
"""A published round trip above a minute is no measurement: refused."""

MAX_FAILURE_CHARS = 1024
"""A failed doctor run says why in one or two lines; the full log stays on the
node."""

MAX_COUNTER = MAX_UINT
"""Counters, epochs and byte sizes stay within a signed 64-bit integer, which
CBOR encodes without bignum tags and sqlite and Prometheus store exactly."""

# --- vocabularies -----------------------------------------------------------

BackendKind = Literal["torch", "mlx"]
Recipe = Literal["fp32", "bf16", "fp16", "q8", "q4"]
Tier = Literal["operator", "bootstrap", "managed"]
CapabilityResult = Literal["admitted", "failed"]
Reach = Literal["direct", "relayed", "unknown"]
"""How peers reach the node (`mesh.reachability`): `direct` at its
advertised addresses, `relayed` through a relay whose ports it advertises
(`mesh.relay`), `unknown` until a check says so, and for a node found
behind NAT that holds no relay yet."""

BACKEND_KINDS: frozenset[BackendKind] = frozenset(get_args(BackendKind))
RECIPES: frozenset[Recipe] = frozenset(get_args(Recipe))
TIERS: frozenset[Tier] = frozenset(get_args(Tier))
CAPABILITY_RESULTS: frozenset[CapabilityResult] = frozenset(get_args(CapabilityResult))
REACHES: frozenset[Reach] = frozenset(get_args(Reach))

# Drop reasons, as counted by the membership core.
RECORD_OVERSIZED = "record_oversized"
RECORD_MALFORMED = "record_malformed"
RECORD_BAD_FIELD = "record_bad_field"
BAD_SIGNATURE = "bad_signature"

_SEQ_LIMIT = 2**64
"""`record_signing_bytes` writes `seq` as 8 unsigned bytes."""


class RecordError(ValueError):
    """A record body that must be dropped; `reason` is the counted drop reason.

    `detail` says which field and why, for logs and for the node that built a
    bad record of its own.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def _bad(detail: str) -> RecordError:
    return RecordError(RECORD_BAD_FIELD, detail)


# --- field checks -----------------------------------------------------------
# The rules are mesh.fields'; `_as_record_error` turns a FieldError raised in
# a constructor into RecordError(record_bad_field). These name our bounds.


def _record_error(exc: FieldError) -> RecordError:
    return _bad(exc.detail)


_as_record_error = reraise_as(_record_error)


def _model_name(value: object, name: str) -> str:
    return text(value, name, max_chars=MAX_MODEL_NAME_CHARS, printable=True)


def _address(value: object, name: str) -> str:
    # Printable ASCII, as on the wire (mesh.wire), so it can be logged unescaped.
    return text(value, name, max_chars=MAX_ADDRESS_CHARS, printable=True, ascii_only=True)


# --- schema -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RelayedAt:
    """One relay a node behind NAT holds a reservation at: the relay's node
    id (hex) and the ports it opened for the node's planes and API."""

    via: str
    control: str
    data: str
    api: str

    @_as_record_error
    def __post_init__(self) -> None:
        hex_text(self.via, "addresses.relayed.via", min_chars=64, max_chars=64)
        for name in ("control", "data", "api"):
            _address(getattr(self, name), f"addresses.relayed.{name}")


@dataclass(frozen=True, slots=True)
class Addresses:
    """Where to reach the node: control plane (gossip, Raft), data plane
    (activations), if it serves one, the HTTP API, and, if it relays for
    nodes behind NAT, where they reserve (`mesh.relay`). A node reached
    through relays advertises the first one's ports as `control`, `data`
    and `api`, and names every relay it holds in `relayed`, the advertised
    one first, so a dialer can go through another when that one is down
    (`dial_addresses`)."""

    control: str
    data: str
    api: str | None = None
    relay: str | None = None
    relayed: tuple[RelayedAt, ...] = ()

    @_as_record_error
    def __post_init__(self) -> None:
        _address(self.control, "addresses.control")
        _address(self.data, "addresses.data")
        for name in ("api", "relay"):
            if getattr(self, name) is not None:
                _address(getattr(self, name), f"addresses.{name}")
        if not isinstance(self.relayed, tuple) or not all(
            isinstance(at, RelayedAt) for at in self.relayed
        ):
            raise FieldError("addresses.relayed must be a list of relays")
        if len(self.relayed) > MAX_RELAYED:
            raise FieldError(f"addresses.relayed names more than {MAX_RELAYED} relays")


def dial_addresses(addresses: Addresses, is_down: Callable[[str], bool]) -> Addresses:
    """Where to dial a node: as advertised, unless the relay its addresses
    go through is down (`is_down(relay id hex)`, the dialer's own view)
    and another relay it holds is not; then through that one. The node
    itself moves its advertised addresses when it loses a relay, but that
    news takes a gossip round to arrive, and a relay whose host vanished
    is only noticed by the node after `mesh.relay.SILENT_S`."""
    if not addresses.relayed or not is_down(addresses.relayed[0].via):
        return addresses
    other = next((at for at in addresses.relayed[1:] if not is_down(at.via)), None)
    if other is None:
        return addresses
    return replace(addresses, control=other.control, data=other.data, api=other.api)


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """The compute the node offers: placement needs the memory to size shards."""

    kind: BackendKind
    device: str
    memory_bytes: int

    @_as_record_error
    def __post_init__(self) -> None:
        one_of(self.kind, "backend.kind", BACKEND_KINDS)
        text(self.device, "backend.device", max_chars=MAX_DEVICE_CHARS)
        uint(self.memory_bytes, "backend.memory_bytes")


@dataclass(frozen=True, slots=True)
class Assignment:
    """The shard this node is meant to serve, and who may change it (ADR-0026).

    `managed` repeats what `tier == "managed"` says because the ADR makes the
    flag part of the contract; a record where they disagree is rejected so no
    reader ever has to decide which one to believe.
    """

    model: str
    layers: tuple[int, int]
    recipe: Recipe
    tier: Tier
    managed: bool
    epoch: int

    @_as_record_error
    def __post_init__(self) -> None:
        _model_name(self.model, "assignment.model")
        object.__setattr__(
            self, "layers", span(self.layers, "assignment.layers", high=MAX_LAYER_INDEX)
        )
        one_of(self.recipe, "assignment.recipe", RECIPES)
        one_of(self.tier, "assignment.tier", TIERS)
        boolean(self.managed, "assignment.managed")
        uint(self.epoch, "assignment.epoch")
        if self.managed != (self.tier == "managed"):
            raise _bad(f"assignment.managed={self.managed} contradicts tier={self.tier!r}")


@dataclass(frozen=True, slots=True)
class LedgerNotice:
    """The Raft leader's word on the placement ledger it has applied.

    Only a few trusted nodes replicate the ledger by Raft; every other
    member follows it from this notice, gossiped in the leader's record
    (which the leader signs like any record): when its copy is older, it
    pulls the ledger whose digest this names from a voter
    (`runtime.node.ledger_follower`). Who may be believed is the follower's
    business: a notice is only a claim by the record's subject."""

    term: int
    index: int
    digest: str
    """sha256 of the ledger's snapshot at `index`, hex."""
    changed: tuple[tuple[str, int], ...] = ()
    """The nodes whose assignment or quarantine the latest commits changed
    (`consensus.ledger.changed_node`), each with the index of that commit
    (at most `MAX_NOTICE_CHANGES`, newest last): a member pulls at once when
    its own id is here, and otherwise lazily, so a swarm of thousands does
    not pull the ledger on every commit."""

    @_as_record_error
    def __post_init__(self) -> None:
        uint(self.term, "ledger.term")
        uint(self.index, "ledger.index")
        hex_text(self.digest, "ledger.digest", min_chars=64, max_chars=64)
        if not isinstance(self.changed, (list, tuple)) or len(self.changed) > MAX_NOTICE_CHANGES:
            raise _bad(f"ledger.changed must be a list of at most {MAX_NOTICE_CHANGES} entries")
        pairs = []
        for pair in self.changed:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise _bad("ledger.changed entries are [node_id, index]")
            node = hex_text(pair[0], "ledger.changed node", min_chars=64, max_chars=64)
            pairs.append((node, uint(pair[1], "ledger.changed index")))
        object.__setattr__(self, "changed", tuple(pairs))


@dataclass(frozen=True, slots=True)
class CapabilityReport:
    """The outcome of this node's `doctor` for one shard and recipe.

    Only an admitted, unexpired report makes a node routable. An admitted
    report carries no failure text and a failed one must say why, so the
    status API can always explain a node that is not serving.
    """

    result: CapabilityResult
    model: str
    manifest_digest: str
    layers: tuple[int, int]
    recipe: Recipe
    backend: BackendKind
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    validated_at: float
    expires_at: float
    failure: str | None = None
    num_layers: int | None = None
    """Layers in the whole model (from the manifest). Without it a reader
    could only guess the model's length from the spans it has seen, and a
    first shard [0, 3) of an 8-layer model would look like a complete
    3-layer one."""

    @_as_record_error
    def __post_init__(self) -> None:
        one_of(self.result, "capability.result", CAPABILITY_RESULTS)
        _model_name(self.model, "capability.model")
        hex_text(self.manifest_digest, "capability.manifest_digest", max_chars=MAX_DIGEST_HEX_CHARS)
        object.__setattr__(
            self, "layers", span(self.layers, "capability.layers", high=MAX_LAYER_INDEX)
        )
        one_of(self.recipe, "capability.recipe", RECIPES)
        one_of(self.backend, "capability.backend", BACKEND_KINDS)
        for name in ("prefill_tokens_per_s", "decode_tokens_per_s"):
            value = number(getattr(self, name), f"capability.{name}", non_negative=True)
            object.__setattr__(self, name, value)
        for name in ("validated_at", "expires_at"):
            object.__setattr__(self, name, number(getattr(self, name), f"capability.{name}"))
        if self.expires_at < self.validated_at:
            raise _bad("capability.expires_at is before validated_at")
        if self.num_layers is not None:
            uint(self.num_layers, "capability.num_layers", low=1, high=MAX_LAYER_INDEX)
            if self.layers[1] > self.num_layers:
                raise _bad("capability.layers end past capability.num_layers")
        if self.result == "admitted":
            if self.failure is not None:
                raise _bad("an admitted capability report carries no failure")
        elif self.failure is None:
            raise _bad("a failed capability report must say why (failure)")
        else:
            text(self.failure, "capability.failure", max_chars=MAX_FAILURE_CHARS)


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """Everything a node publishes about itself (see the module docstring).

    `models` and `demand` accept any sequence / mapping and are stored as a
    tuple and a read-only mapping so a record cannot change after it is
    signed. `demand` is left out of the hash (mappings are not hashable).
    """

    addresses: Addresses
    started_at: float
    backend: BackendInfo | None = None
    assignment: Assignment | None = None
    capability: CapabilityReport | None = None
    models: tuple[str, ...] = ()
    spare: bool = False
    demand: Mapping[str, int] = field(default_factory=dict, hash=False)
    ledger: LedgerNotice | None = None
    """Only on the Raft leader's record (see `LedgerNotice`)."""
    sessions: int = 0
    """Inference sessions open on the node when it last published: its load,
    as other members' status pages show it. Republished at most every
    `runtime.node.record_publisher.LOAD_PUBLISH_S`, so it lags by up to that."""
    reach: Reach = "unknown"
    """How peers reach the node (see `Reach`); a record from a node older
    than the field has none and reads as `unknown`."""
    rtt_us: Mapping[str, int] = field(default_factory=dict, hash=False)
    """Member id (hex) -> the round trip this node's membership probes
    measured to it, in microseconds (`mesh.membership.Membership.rtts`), at
    most `MAX_RTT_PEERS`: what routes price the hop after this one by."""

    @_as_record_error
    def __post_init__(self) -> None:
        if self.ledger is not None and not isinstance(self.ledger, LedgerNotice):
            raise _bad("ledger must be a LedgerNotice or None")
        if not isinstance(self.addresses, Addresses):
            raise _bad("addresses must be an Addresses")
        object.__setattr__(self, "started_at", number(self.started_at, "started_at"))
        if self.backend is not None and not isinstance(self.backend, BackendInfo):
            raise _bad("backend must be a BackendInfo or None")
        if self.assignment is not None and not isinstance(self.assignment, Assignment):
            raise _bad("assignment must be an Assignment or None")
        if self.capability is not None and not isinstance(self.capability, CapabilityReport):
            raise _bad("capability must be a CapabilityReport or None")
        object.__setattr__(self, "models", _check_models(self.models))
        boolean(self.spare, "spare")
        object.__setattr__(self, "demand", _check_demand(self.demand))
        uint(self.sessions, "sessions")
        one_of(self.reach, "reach", REACHES)
        object.__setattr__(self, "rtt_us", _check_rtts(self.rtt_us))


def _check_models(value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, tuple | list):
        raise _bad("models must be a list of model names")
    if len(value) > MAX_MODELS:
        raise _bad(f"models lists more than {MAX_MODELS} entries")
    names = tuple(_model_name(name, "models[]") for name in value)
    if len(set(names)) != len(names):
        raise _bad("models lists a model twice")
    return names


def _check_demand(value: object) -> Mapping[str, int]:
    if not isinstance(value, Mapping):
        raise _bad("demand must be a map of model name to count")
    if len(value) > MAX_DEMAND_ENTRIES:
        raise _bad(f"demand has more than {MAX_DEMAND_ENTRIES} entries")
    checked = {
        _model_name(model, "demand key"): uint(count, f"demand[{model!r}]")
        for model, count in value.items()
    }
    return MappingProxyType(checked)


def _check_rtts(value: object) -> Mapping[str, int]:
    if not isinstance(value, Mapping):
        raise _bad("rtt_us must be a map of node id to microseconds")
    if len(value) > MAX_RTT_PEERS:
        raise _bad(f"rtt_us has more than {MAX_RTT_PEERS} entries")
    checked = {
        hex_text(node, "rtt_us key", min_chars=64, max_chars=64): uint(
            rtt, f"rtt_us[{node!r}]", high=MAX_RTT_US
        )
        for node, rtt in value.items()
    }
    return MappingProxyType(checked)


# --- encoding ---------------------------------------------------------------


def _layers_out(layers: tuple[int, int]) -> list[int]:
    return [layers[0], layers[1]]


def _record_map(record: NodeRecord) -> dict[str, Any]:
    """The record as plain maps and lists: the CBOR body and the JSON view."""
    addresses = record.addresses
    backend = record.backend
    assignment = record.assignment
    capability = record.capability
    return {
        "addresses": _addresses_map(addresses),
        "backend": None
        if backend is None
        else {"kind": backend.kind, "device": backend.device, "memory_bytes": backend.memory_bytes},
        "assignment": None
        if assignment is None
        else {
            "model": assignment.model,
            "layers": _layers_out(assignment.layers),
            "recipe": assignment.recipe,
            "tier": assignment.tier,
            "managed": assignment.managed,
            "epoch": assignment.epoch,
        },
        "capability": None
        if capability is None
        else {
            "result": capability.result,
            "model": capability.model,
            "manifest_digest": capability.manifest_digest,
            "layers": _layers_out(capability.layers),
            "recipe": capability.recipe,
            "backend": capability.backend,
            "prefill_tokens_per_s": capability.prefill_tokens_per_s,
            "decode_tokens_per_s": capability.decode_tokens_per_s,
            "validated_at": capability.validated_at,
            "expires_at": capability.expires_at,
            "failure": capability.failure,
            "num_layers": capability.num_layers,
        },
        "models": list(record.models),
        "spare": record.spare,
        "demand": dict(record.demand),
        "sessions": record.sessions,
        "reach": record.reach,
        "started_at": record.started_at,
        "ledger": None
        if record.ledger is None
        else {
            "term": record.ledger.term,
            "index": record.ledger.index,
            "digest": record.ledger.digest,
            "changed": [list(pair) for pair in record.ledger.changed],
        },
    }


def _addresses_map(addresses: Addresses) -> dict[str, Any]:
    """`relayed` only when the node is reached through relays, so a direct
    node's record encodes as it did before the field."""
    plain = {
        "control": addresses.control,
        "data": addresses.data,
        "api": addresses.api,
        "relay": addresses.relay,
    }
    if not addresses.relayed:
        return plain
    relayed = [
        {"via": at.via, "control": at.control, "data": at.data, "api": at.api}
        for at in addresses.relayed
    ]
    return {**plain, "relayed": relayed}


def _with_rtts(view: dict[str, Any], record: NodeRecord) -> dict[str, Any]:
    """`rtt_us` only when the record has some, so records without
    measurements encode as they did before the field."""
    return {**view, "rtt_us": dict(record.rtt_us)} if record.rtt_us else view


def encode_record_body(record: NodeRecord) -> bytes:
    """The record's CBOR body, canonical so equal records give equal bytes.

    Raises `RecordError("record_oversized")` rather than producing a body that
    every peer would drop.
    """
    body = cbor2.dumps(_with_rtts(_record_map(record), record), canonical=True)
    if len(body) > MAX_RECORD_BODY_BYTES:
        raise RecordError(RECORD_OVERSIZED, f"{len(body)} bytes exceeds {MAX_RECORD_BODY_BYTES}")
    return body


_PLAIN_SCALARS = (str, int, float, bool, type(None))


def _is_plain(value: object, depth: int = 0) -> bool:
    """Only maps, lists, text, numbers, booleans and null: the belt to the
    tag override's braces, should a future cbor2 decode another tag itself."""
    if depth > MAX_CBOR_DEPTH:
        return False
    if isinstance(value, _PLAIN_SCALARS):
        return True
    if isinstance(value, list):
        return all(_is_plain(item, depth + 1) for item in value)
    if isinstance(value, dict):
        return all(
            isinstance(key, str) and _is_plain(item, depth + 1) for key, item in value.items()
        )
    return False


def _parse_cbor(body: bytes) -> Any:
    """The body under the wire's strict CBOR dialect (no tags, no
    indefinite lengths, no duplicate keys, depth cap, nothing after the
    item), then the record's own narrower rule on value types."""
    if not isinstance(body, bytes):
        raise RecordError(RECORD_MALFORMED, "body is not bytes")
    try:
        value = decode_strict_cbor(body, max_bytes=MAX_RECORD_BODY_BYTES, allow_floats=True)
    except DecodeError as exc:
        if exc.reason == REASON_OVERSIZED:
            raise RecordError(RECORD_OVERSIZED, f"over {MAX_RECORD_BODY_BYTES} bytes") from None
        if exc.reason == REASON_BAD_FIELD:  # e.g. a map over the dialect's entry cap
            raise RecordError(RECORD_BAD_FIELD, f"not a valid record ({exc.detail})") from None
        raise RecordError(RECORD_MALFORMED, f"not valid CBOR ({exc.reason})") from None
    if not _is_plain(value):
        raise RecordError(RECORD_MALFORMED, "record holds values of types outside the schema")
    return value


_MISSING = object()


def _field(obj: dict[str, Any], key: str, where: str, *, nullable: bool = False) -> Any:
    """A known key; a nullable key may be absent (an older node may omit it)."""
    value = obj.get(key, _MISSING)
    if value is _MISSING:
        if nullable:
            return None
        raise _bad(f"{where}{key} is missing")
    return value


def _submap(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(f"{name} must be a map")
    return value


def _decode_addresses(value: Any) -> Addresses:
    obj = _submap(value, "addresses")
    relayed = obj.get("relayed", [])
    if not isinstance(relayed, list) or len(relayed) > MAX_RELAYED:
        raise _bad(f"addresses.relayed must be a list of at most {MAX_RELAYED} relays")
    return Addresses(
        control=_field(obj, "control", "addresses."),
        data=_field(obj, "data", "addresses."),
        api=_field(obj, "api", "addresses.", nullable=True),
        relay=_field(obj, "relay", "addresses.", nullable=True),
        relayed=tuple(_decode_relayed(at) for at in relayed),
    )


def _decode_relayed(value: Any) -> RelayedAt:
    obj = _submap(value, "addresses.relayed[]")
    where = "addresses.relayed[]."
    return RelayedAt(
        via=_field(obj, "via", where),
        control=_field(obj, "control", where),
        data=_field(obj, "data", where),
        api=_field(obj, "api", where),
    )


def _decode_backend(value: Any) -> BackendInfo | None:
    if value is None:
        return None
    obj = _submap(value, "backend")
    return BackendInfo(
        kind=_field(obj, "kind", "backend."),
        device=_field(obj, "device", "backend."),
        memory_bytes=_field(obj, "memory_bytes", "backend."),
    )


def _decode_assignment(value: Any) -> Assignment | None:
    if value is None:
        return None
    obj = _submap(value, "assignment")
    return Assignment(
        model=_field(obj, "model", "assignment."),
        layers=_field(obj, "layers", "assignment."),
        recipe=_field(obj, "recipe", "assignment."),
        tier=_field(obj, "tier", "assignment."),
        managed=_field(obj, "managed", "assignment."),
        epoch=_field(obj, "epoch", "assignment."),
    )


def _decode_capability(value: Any) -> CapabilityReport | None:
    if value is None:
        return None
    obj = _submap(value, "capability")
    where = "capability."
    return CapabilityReport(
        result=_field(obj, "result", where),
        model=_field(obj, "model", where),
        manifest_digest=_field(obj, "manifest_digest", where),
        layers=_field(obj, "layers", where),
        recipe=_field(obj, "recipe", where),
        backend=_field(obj, "backend", where),
        prefill_tokens_per_s=_field(obj, "prefill_tokens_per_s", where),
        decode_tokens_per_s=_field(obj, "decode_tokens_per_s", where),
        validated_at=_field(obj, "validated_at", where),
        expires_at=_field(obj, "expires_at", where),
        failure=_field(obj, "failure", where, nullable=True),
        num_layers=_field(obj, "num_layers", where, nullable=True),
    )


def _decode_ledger(value: Any) -> LedgerNotice | None:
    if value is None:
        return None
    obj = _submap(value, "ledger")
    return LedgerNotice(
        term=_field(obj, "term", "ledger."),
        index=_field(obj, "index", "ledger."),
        digest=_field(obj, "digest", "ledger."),
        changed=obj.get("changed", ()),
    )


def decode_record_body(body: bytes) -> NodeRecord:
    """Parse and check a record body from any peer; raises `RecordError`.

    Reasons: `record_oversized` (over `MAX_RECORD_BODY_BYTES`, checked before
    parsing), `record_malformed` (not one well-formed, tag-free CBOR map) and
    `record_bad_field` (a known field is missing, mistyped or out of range).
    Unknown keys are ignored.
    """
    obj = _parse_cbor(body)
    if not isinstance(obj, dict):
        raise RecordError(RECORD_MALFORMED, "a record body is a CBOR map")
    models = obj.get("models", ())
    demand = obj.get("demand", {})
    return NodeRecord(
        addresses=_decode_addresses(_field(obj, "addresses", "")),
        started_at=_field(obj, "started_at", ""),
        backend=_decode_backend(obj.get("backend")),
        assignment=_decode_assignment(obj.get("assignment")),
        capability=_decode_capability(obj.get("capability")),
        models=models,
        spare=obj.get("spare", False),
        demand=demand,
        ledger=_decode_ledger(obj.get("ledger")),
        sessions=obj.get("sessions", 0),
        reach=obj.get("reach", "unknown"),
        rtt_us=obj.get("rtt_us", {}),
    )


def validate_record_body(body: bytes) -> str | None:
    """The membership core's hook: a drop reason for a bad body, else None."""
    try:
        decode_record_body(body)
    except RecordError as exc:
        return exc.reason
    return None


# --- signing ----------------------------------------------------------------


def sign_record(signer: Signer, seq: int, record: NodeRecord) -> Record:
    """Encode `record` and sign it as `signer`'s own record number `seq`.

    The caller keeps `seq` increasing (newest wins at every member).
    """
    if not is_uint(seq, high=_SEQ_LIMIT - 1):
        raise ValueError(f"seq {seq!r} must be an integer in [0, 2**64)")
    body = encode_record_body(record)
    node = signer.node_id
    return Record(
        node=node, seq=seq, body=body, signature=signer.sign(record_signing_bytes(node, seq, body))
    )


def check_record(record: Record, verifier: Verifier) -> str | None:
    """A drop reason for a gossiped record, or None when it may be stored.

    Order matters: the size cap first (cheap, and bounds the bytes we hash),
    then the signature of the subject itself (so unauthenticated bytes are
    never parsed and a record about X signed by Y is refused), then the body.
    """
    body = record.body
    if not all(isinstance(part, bytes) for part in (body, record.node, record.signature)):
        return RECORD_MALFORMED
    if len(body) > MAX_RECORD_BODY_BYTES:
        return RECORD_OVERSIZED
    seq = record.seq
    if not is_uint(seq, high=_SEQ_LIMIT - 1):
        return RECORD_BAD_FIELD
    if not verifier(record.node, record_signing_bytes(record.node, seq, body), record.signature):
        return BAD_SIGNATURE
    return validate_record_body(body)


# --- JSON view --------------------------------------------------------------


def record_to_json(record: NodeRecord, node_id: bytes | None = None) -> dict[str, Any]:
    """The record for the HTTP status API: layers as `[a, b]`, plain types.

    Given `node_id`, it is included as hex under `"node_id"`.
    """
    view = _with_rtts(_record_map(record), record)
    if node_id is not None:
        view = {"node_id": node_id_text(node_id), **view}
    return view
