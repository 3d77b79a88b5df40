"""Node records: schema validation, strict decoding and signatures."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.identity import Identity, verify
from mesh.messages import Record, record_signing_bytes
from mesh.records import (
    MAX_DEMAND_ENTRIES,
    MAX_LAYER_INDEX,
    MAX_MODEL_NAME_CHARS,
    MAX_MODELS,
    MAX_RECORD_BODY_BYTES,
    MAX_RELAYED,
    MAX_RTT_PEERS,
    MAX_RTT_US,
    Addresses,
    Assignment,
    BackendInfo,
    CapabilityReport,
    LedgerNotice,
    NodeRecord,
    RecordError,
    RelayedAt,
    check_record,
    decode_record_body,
    dial_addresses,
    encode_record_body,
    record_to_json,
    sign_record,
    validate_record_body,
)

ALICE = Identity.from_seed(bytes(range(32)))
BOB = Identity.from_seed(bytes(range(1, 33)))
DIGEST = "ab" * 32

# --- strategies -------------------------------------------------------------

model_names = st.text(
    st.characters(codec="utf-8", categories=("L", "N", "P", "S")),
    min_size=1,
    max_size=MAX_MODEL_NAME_CHARS,
)
layer_spans = st.tuples(
    st.integers(0, MAX_LAYER_INDEX - 1), st.integers(1, MAX_LAYER_INDEX)
).filter(lambda span: span[0] < span[1])
finite = st.floats(allow_nan=False, allow_infinity=False)
rates = st.floats(min_value=0, max_value=1e9, allow_nan=False)
counters = st.integers(0, 2**63 - 1)
recipes = st.sampled_from(["fp32", "bf16", "fp16", "q8", "q4"])
kinds = st.sampled_from(["torch", "mlx"])
endpoints = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=40)
relayed_at = st.builds(
    RelayedAt,
    via=st.sampled_from(["ab" * 32, "cd" * 32]),
    control=endpoints,
    data=endpoints,
    api=endpoints,
)
addresses = st.builds(
    Addresses,
    control=endpoints,
    data=endpoints,
    api=st.none() | endpoints,
    relayed=st.lists(relayed_at, max_size=MAX_RELAYED).map(tuple),
)
backends = st.builds(
    BackendInfo, kind=kinds, device=st.text(min_size=1, max_size=16), memory_bytes=counters
)


@st.composite
def assignments(draw: st.DrawFn) -> Assignment:
    tier = draw(st.sampled_from(["operator", "bootstrap", "managed"]))
    return Assignment(
        model=draw(model_names),
        layers=draw(layer_spans),
        recipe=draw(recipes),
        tier=tier,
        managed=tier == "managed",
        epoch=draw(counters),
    )


@st.composite
def capabilities(draw: st.DrawFn) -> CapabilityReport:
    result = draw(st.sampled_from(["admitted", "failed"]))
    validated = draw(st.floats(-1e12, 1e12))
    return CapabilityReport(
        result=result,
        model=draw(model_names),
        manifest_digest=draw(st.text("0123456789abcdef", min_size=1, max_size=128)),
        layers=draw(layer_spans),
        recipe=draw(recipes),
        backend=draw(kinds),
        prefill_tokens_per_s=draw(rates),
        decode_tokens_per_s=draw(rates),
        validated_at=validated,
        expires_at=validated + draw(st.floats(0, 1e6)),
        failure=None if result == "admitted" else draw(st.text(min_size=1, max_size=80)),
    )


node_records = st.builds(
    NodeRecord,
    addresses=addresses,
    started_at=finite,
    backend=st.none() | backends,
    assignment=st.none() | assignments(),
    capability=st.none() | capabilities(),
    models=st.lists(model_names, max_size=5, unique=True).map(tuple),
    spare=st.booleans(),
    demand=st.dictionaries(model_names, counters, max_size=5),
    sessions=counters,
    reach=st.sampled_from(["direct", "relayed", "unknown"]),
    rtt_us=st.dictionaries(st.sampled_from(["ab" * 32, "cd" * 32]), st.integers(0, MAX_RTT_US)),
    ledger=st.none()
    | st.builds(
        LedgerNotice,
        term=counters,
        index=counters,
        digest=st.just(DIGEST),
        changed=st.lists(st.tuples(st.just("cd" * 32), counters), max_size=16).map(tuple),
    ),
)


def sample_record(**changes: Any) -> NodeRecord:
    record = NodeRecord(
        addresses=Addresses("tcp://10.0.0.1:7000", "tcp://10.0.0.1:7001", "http://10.0.0.1:8000"),
        started_at=1000.0,
        backend=BackendInfo("torch", "cuda:0", 80 * 2**30),
        assignment=Assignment("qwen3-8l", (0, 3), "bf16", "operator", False, 1),
        capability=CapabilityReport(
            result="admitted",
            model="qwen3-8l",
            manifest_digest=DIGEST,
            layers=(0, 3),
            recipe="bf16",
            backend="torch",
            prefill_tokens_per_s=5000.0,
            decode_tokens_per_s=80.5,
            validated_at=1010.0,
            expires_at=1610.0,
        ),
        models=("qwen3-8l",),
        spare=False,
        demand={"qwen3-8l": 3},
        sessions=2,
    )
    return dataclasses.replace(record, **changes)


def raw_map(record: NodeRecord | None = None) -> dict[str, Any]:
    """A valid body as a plain dict, for hand-made bad bodies."""
    return cbor2.loads(encode_record_body(record or sample_record()))


def reason_of(obj: Any) -> str | None:
    return validate_record_body(cbor2.dumps(obj))


# --- round trips ------------------------------------------------------------


@settings(max_examples=300)
@given(node_records)
def test_round_trip(record: NodeRecord) -> None:
    body = encode_record_body(record)
    decoded = decode_record_body(body)
    assert decoded == record
    assert encode_record_body(decoded) == body  # canonical: same record, same bytes
    assert validate_record_body(body) is None


@settings(max_examples=100)
@given(node_records, st.integers(0, 2**64 - 1))
def test_signed_round_trip(record: NodeRecord, seq: int) -> None:
    signed = sign_record(ALICE, seq, record)
    assert signed.node == ALICE.node_id
    assert signed.seq == seq
    assert check_record(signed, verify) is None
    assert decode_record_body(signed.body) == record


@settings(max_examples=100)
@given(node_records)
def test_json_view_is_plain_json(record: NodeRecord) -> None:
    view = record_to_json(record, node_id=ALICE.node_id)
    assert json.loads(json.dumps(view)) == view
    assert view["node_id"] == ALICE.node_id.hex()
    if record.assignment is not None:
        assert view["assignment"]["layers"] == list(record.assignment.layers)
    if record.capability is not None:
        assert view["capability"]["layers"] == list(record.capability.layers)


def test_json_view_fields() -> None:
    view = record_to_json(sample_record())
    assert "node_id" not in view
    assert view["addresses"]["api"] == "http://10.0.0.1:8000"
    assert view["assignment"] == {
        "model": "qwen3-8l",
        "layers": [0, 3],
        "recipe": "bf16",
        "tier": "operator",
        "managed": False,
        "epoch": 1,
    }
    assert view["capability"]["result"] == "admitted"
    assert view["demand"] == {"qwen3-8l": 3}
    assert view["sessions"] == 2


def test_records_are_immutable_and_hashable() -> None:
    record = sample_record(demand={"m": 1}, models=["m"])
    assert record.models == ("m",)
    with pytest.raises(TypeError):
        record.demand["m"] = 2  # type: ignore[index]
    assert hash(record) == hash(sample_record(demand={"m": 1}, models=("m",)))


def test_integer_times_are_stored_as_floats() -> None:
    record = sample_record(started_at=7)
    assert isinstance(record.started_at, float)
    assert decode_record_body(encode_record_body(record)) == record


def test_unknown_keys_are_ignored() -> None:
    obj = raw_map()
    obj["future_field"] = {"anything": [1, 2, 3]}
    obj["capability"]["future_metric"] = 1.5
    assert decode_record_body(cbor2.dumps(obj)) == sample_record()


def test_absent_optional_fields_take_defaults() -> None:
    minimal = {"addresses": {"control": "c", "data": "d"}, "started_at": 1.0}
    record = decode_record_body(cbor2.dumps(minimal))
    assert record == NodeRecord(addresses=Addresses("c", "d"), started_at=1.0)
    assert record.reach == "unknown"


def test_a_record_from_before_reach_decodes_as_unknown_and_new_ones_say_it() -> None:
    old = raw_map()
    del old["reach"]  # what a node older than issue 29 signs
    assert decode_record_body(cbor2.dumps(old)).reach == "unknown"
    direct = sample_record(reach="direct")
    assert raw_map(direct)["reach"] == "direct"
    assert decode_record_body(encode_record_body(direct)).reach == "direct"
    assert record_to_json(direct)["reach"] == "direct"


# --- rejections -------------------------------------------------------------


def test_round_trips_are_published_by_id_and_absent_from_records_without_them() -> None:
    assert "rtt_us" not in raw_map(sample_record())
    measured = sample_record(rtt_us={"ab" * 32: 40_000})
    assert decode_record_body(encode_record_body(measured)).rtt_us == {"ab" * 32: 40_000}
    assert record_to_json(measured)["rtt_us"] == {"ab" * 32: 40_000}


RELAY_B, RELAY_E = "b" * 64, "e" * 64
HOME = Addresses(
    "tcp://b:1",
    "tcp://b:2",
    "http://b:3",
    relayed=(
        RelayedAt(RELAY_B, "tcp://b:1", "tcp://b:2", "http://b:3"),
        RelayedAt(RELAY_E, "tcp://e:1", "tcp://e:2", "http://e:3"),
    ),
)
"""A home node advertising relay b's ports, holding e's too."""


def test_the_relays_a_node_holds_ride_in_its_record_and_a_direct_node_has_none() -> None:
    assert "relayed" not in raw_map(sample_record())["addresses"]
    record = sample_record(addresses=HOME, reach="relayed")
    assert decode_record_body(encode_record_body(record)).addresses == HOME
    assert record_to_json(record)["addresses"]["relayed"][1]["via"] == RELAY_E


def test_a_dialer_goes_through_the_other_relay_when_the_advertised_one_is_down() -> None:
    assert dial_addresses(HOME, lambda relay: False) == HOME
    moved = dial_addresses(HOME, lambda relay: relay == RELAY_B)
    assert (moved.control, moved.data, moved.api) == ("tcp://e:1", "tcp://e:2", "http://e:3")
    assert dial_addresses(HOME, lambda relay: True) == HOME, "both down: as advertised"
    direct = Addresses("tcp://a:1", "tcp://a:2")
    assert dial_addresses(direct, lambda relay: True) == direct


def test_oversized_body() -> None:
    body = cbor2.dumps({**raw_map(), "padding": "x" * MAX_RECORD_BODY_BYTES})
    assert len(body) > MAX_RECORD_BODY_BYTES
    assert validate_record_body(body) == "record_oversized"
    with pytest.raises(RecordError) as info:
        decode_record_body(body)
    assert info.value.reason == "record_oversized"


def test_encoding_refuses_a_record_peers_would_drop() -> None:
    names = [f"{i:03d}" + "m" * (MAX_MODEL_NAME_CHARS - 3) for i in range(MAX_MODELS)]
    record = sample_record(models=tuple(names), demand=dict.fromkeys(names, 1))
    with pytest.raises(RecordError) as info:
        encode_record_body(record)
    assert info.value.reason == "record_oversized"


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xff\xfe garbage",
        b"\x1f",  # reserved additional information
        b"\xa1",  # truncated map
        b"\xbf\xff",  # indefinite-length map
        cbor2.dumps(["not", "a", "map"]),
        cbor2.dumps(42),
        cbor2.dumps({b"bytes-key": 1}),
        cbor2.dumps({"addresses": b"raw bytes"}),
        cbor2.dumps(cbor2.CBORTag(55799, {"started_at": 1.0})),  # self-describe tag
        cbor2.dumps({"started_at": cbor2.CBORTag(1, 0)}),  # epoch datetime
        cbor2.dumps({"started_at": cbor2.CBORTag(4242, 0)}),  # unknown tag
        cbor2.dumps({"models": cbor2.CBORTag(258, ["a", "b"])}),  # a set (tag 258), in one order
        b"\xa2\x61a\x01\x61a\x02",  # duplicate key "a"
        b"\x81" * 20 + b"\x01",  # nested past the depth cap
    ],
)
def test_malformed_bodies(body: bytes) -> None:
    assert validate_record_body(body) == "record_malformed"


def test_trailing_bytes_are_malformed() -> None:
    assert validate_record_body(encode_record_body(sample_record()) + b"\x00") == (
        "record_malformed"
    )


def _with(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    obj = raw_map()
    target = obj
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return obj


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("started_at",), "yesterday"),
        (("started_at",), math.nan),
        (("started_at",), math.inf),
        (("started_at",), True),
        (("spare",), 1),
        (("models",), "qwen3-8l"),
        (("models",), ["a", "a"]),
        (("models",), [f"m{i}" for i in range(MAX_MODELS + 1)]),
        (("models",), ["x" * (MAX_MODEL_NAME_CHARS + 1)]),
        (("models",), [""]),
        (("models",), ["line\nbreak"]),
        (("demand",), {"m": -1}),
        (("demand",), {"m": 1.5}),
        (("demand",), {f"m{i}": 1 for i in range(MAX_DEMAND_ENTRIES + 1)}),
        (("demand",), ["m", 1]),
        (("sessions",), -1),
        (("sessions",), 1.5),
        (("sessions",), True),
        (("reach",), "behind-nat"),
        (("reach",), None),
        (("reach",), 1),
        (("rtt_us",), {"ab" * 32: -1}),
        (("rtt_us",), {"ab" * 32: MAX_RTT_US + 1}),
        (("rtt_us",), {"AB" * 32: 1}),
        (("rtt_us",), {"ab": 1}),
        (("rtt_us",), {f"{i:064x}": 1 for i in range(MAX_RTT_PEERS + 1)}),
        (("rtt_us",), ["ab" * 32, 1]),
        (("addresses",), "tcp://x:1"),
        (("addresses", "control"), ""),
        (("addresses", "data"), 7001),
        (("addresses", "api"), "tcp://h\u00e9:1"),
        (("addresses", "control"), "tcp://h:1\n"),
        (("addresses", "relayed"), "tcp://x:1"),
        (("addresses", "relayed"), [{"via": "zz", "control": "c", "data": "d", "api": "a"}]),
        (("addresses", "relayed"), [{"via": "ab" * 32, "control": "c", "data": "d"}]),
        (("addresses", "relayed"), [["ab" * 32, "c", "d", "a"]]),
        (
            ("addresses", "relayed"),
            [{"via": "ab" * 32, "control": "c", "data": "d", "api": "a"}] * (MAX_RELAYED + 1),
        ),
        (("backend", "kind"), "cuda"),
        (("backend", "memory_bytes"), -1),
        (("backend", "memory_bytes"), True),
        (("backend", "memory_bytes"), 2**63),
        (("backend",), [1, 2]),
        (("assignment", "layers"), [3, 3]),
        (("assignment", "layers"), [5, 2]),
        (("assignment", "layers"), [0, MAX_LAYER_INDEX + 1]),
        (("assignment", "layers"), [-1, 2]),
        (("assignment", "layers"), [0, 1, 2]),
        (("assignment", "layers"), "0:3"),
        (("assignment", "recipe"), "int4"),
        (("assignment", "tier"), "pinned"),
        (("assignment", "managed"), True),  # tier is "operator"
        (("assignment", "epoch"), -1),
        (("capability", "result"), "maybe"),
        (("capability", "manifest_digest"), "AB" * 32),
        (("capability", "manifest_digest"), "not hex"),
        (("capability", "manifest_digest"), ""),
        (("capability", "decode_tokens_per_s"), math.nan),
        (("capability", "decode_tokens_per_s"), -1.0),
        (("capability", "prefill_tokens_per_s"), math.inf),
        (("capability", "expires_at"), 1000.0),  # before validated_at
        (("capability", "validated_at"), -math.inf),
        (("capability", "failure"), "admitted but broken"),
        (("capability", "layers"), [8, 6]),
    ],
)
def test_bad_fields(path: tuple[str, ...], value: Any) -> None:
    assert reason_of(_with(path, value)) == "record_bad_field"


def test_managed_tier_requires_managed_flag() -> None:
    managed = Assignment("m", (0, 2), "q4", "managed", True, 3)
    assert decode_record_body(encode_record_body(sample_record(assignment=managed))) == (
        sample_record(assignment=managed)
    )
    obj = raw_map(sample_record(assignment=managed))
    obj["assignment"]["managed"] = False
    assert reason_of(obj) == "record_bad_field"
    with pytest.raises(RecordError) as info:
        Assignment("m", (0, 2), "q4", "managed", False, 3)
    assert info.value.reason == "record_bad_field"
    assert "managed" in info.value.detail


def test_failed_report_must_say_why() -> None:
    capability = sample_record().capability
    assert capability is not None
    with pytest.raises(RecordError):
        dataclasses.replace(capability, result="failed")
    failed = dataclasses.replace(capability, result="failed", failure="logits off by 0.3")
    record = sample_record(capability=failed)
    assert decode_record_body(encode_record_body(record)) == record


@pytest.mark.parametrize("key", ["addresses", "started_at"])
def test_missing_required_field(key: str) -> None:
    obj = raw_map()
    del obj[key]
    assert reason_of(obj) == "record_bad_field"


@pytest.mark.parametrize("key", ["model", "layers", "expires_at"])
def test_missing_capability_field(key: str) -> None:
    obj = raw_map()
    del obj["capability"][key]
    assert reason_of(obj) == "record_bad_field"


def test_construction_applies_the_same_checks() -> None:
    with pytest.raises(RecordError):
        sample_record(started_at=math.nan)
    with pytest.raises(RecordError):
        BackendInfo("torch", "cuda:0", -5)
    with pytest.raises(RecordError):
        Assignment("m", (4, 4), "fp32", "operator", False, 0)


@settings(max_examples=500)
@given(st.binary(max_size=600))
def test_arbitrary_bytes_never_escape(body: bytes) -> None:
    assert validate_record_body(body) in (
        None,
        "record_malformed",
        "record_bad_field",
    )


@settings(max_examples=300)
@given(st.data())
def test_corrupted_bodies_never_escape(data: st.DataObject) -> None:
    body = bytearray(encode_record_body(sample_record()))
    for _ in range(data.draw(st.integers(1, 4))):
        index = data.draw(st.integers(0, len(body) - 1))
        body[index] = data.draw(st.integers(0, 255))
    assert validate_record_body(bytes(body)) in (None, "record_malformed", "record_bad_field")


# --- signatures -------------------------------------------------------------


def test_record_signed_by_another_key_is_refused() -> None:
    by_bob = sign_record(BOB, 5, sample_record())
    claims_alice = dataclasses.replace(by_bob, node=ALICE.node_id)
    assert check_record(claims_alice, verify) == "bad_signature"
    assert check_record(by_bob, verify) is None


def test_tampered_body_is_refused() -> None:
    signed = sign_record(ALICE, 5, sample_record())
    other = encode_record_body(sample_record(spare=True))
    assert validate_record_body(other) is None  # a well-formed body, just not the signed one
    assert check_record(dataclasses.replace(signed, body=other), verify) == "bad_signature"
    flipped = bytearray(signed.body)
    flipped[-1] ^= 1
    assert check_record(dataclasses.replace(signed, body=bytes(flipped)), verify) == (
        "bad_signature"
    )


def test_tampered_seq_is_refused() -> None:
    signed = sign_record(ALICE, 5, sample_record())
    assert check_record(dataclasses.replace(signed, seq=6), verify) == "bad_signature"


def test_validly_signed_bad_body_reports_the_body_reason() -> None:
    body = cbor2.dumps(_with(("assignment", "layers"), [3, 1]))
    record = Record(
        node=ALICE.node_id,
        seq=1,
        body=body,
        signature=ALICE.sign(record_signing_bytes(ALICE.node_id, 1, body)),
    )
    assert check_record(record, verify) == "record_bad_field"


def test_oversized_record_is_refused_before_verifying() -> None:
    calls: list[bytes] = []

    def counting_verifier(node: bytes, data: bytes, signature: bytes) -> bool:
        calls.append(data)
        return True

    record = Record(ALICE.node_id, 1, b"\x00" * (MAX_RECORD_BODY_BYTES + 1), b"\x00" * 64)
    assert check_record(record, counting_verifier) == "record_oversized"
    assert calls == []


def test_unsignable_seq() -> None:
    with pytest.raises(ValueError):
        sign_record(ALICE, -1, sample_record())
    with pytest.raises(ValueError):
        sign_record(ALICE, 2**64, sample_record())
    signed = sign_record(ALICE, 1, sample_record())
    assert check_record(dataclasses.replace(signed, seq=-1), verify) == "record_bad_field"


def test_injected_verifier_is_used() -> None:
    """The simulator injects a cheap verifier; check_record must defer to it."""
    signed = sign_record(ALICE, 1, sample_record())
    assert check_record(signed, lambda node, data, sig: False) == "bad_signature"
    forged = dataclasses.replace(signed, signature=b"\x00" * 64)
    assert check_record(forged, lambda node, data, sig: True) is None


@pytest.mark.parametrize(
    "ledger",
    [
        {"term": 1, "index": 2, "digest": "AB" * 32},  # not lowercase hex
        {"term": 1, "index": 2, "digest": "ab" * 31},
        {"term": -1, "index": 2, "digest": DIGEST},
        {"term": 1, "index": 2, "digest": DIGEST, "changed": [["cd" * 32, 1]] * 17},
        {"term": 1, "index": 2, "digest": DIGEST, "changed": [["cd" * 32]]},
        {"term": 1, "index": 2, "digest": DIGEST, "changed": [["zz" * 32, 1]]},
    ],
)
def test_a_bad_ledger_notice_is_a_bad_record(ledger: dict[str, Any]) -> None:
    body = {**raw_map(), "ledger": ledger}
    assert reason_of(body) == "record_bad_field"
