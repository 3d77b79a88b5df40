"""The ledger's commands: strict construction, one canonical encoding, strict decoding.

Every command's bytes are in Raft logs on disk, so the encodings below are
pinned byte for byte: a change to a field's order, a type id or a number's
width breaks them here before it breaks a replica.
"""

from __future__ import annotations

import cbor2
import pytest

from consensus.commands import (
    ASSIGNMENT_COMMANDS,
    COMMAND_TYPE_IDS,
    ELIGIBILITY_COMMANDS,
    MAX_COMMAND_BYTES,
    MAX_INVITATION_USES,
    MAX_TEXT,
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
    decode_command,
    encode_command,
    strict_loads,
)

N1, N2 = (bytes([i]) * 32 for i in (1, 2))


def assign(node: bytes, model: str, epoch: int, tier: str = "managed", at: float = 1.0) -> Assign:
    return Assign(node, model, (0, 8), "bf16", tier, tier == "managed", epoch, at)  # type: ignore[arg-type]


def evidence(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_type_ids_are_the_ones_in_the_logs() -> None:
    assert {cls.__name__: i for cls, i in COMMAND_TYPE_IDS.items()} == {
        "Assign": 1,
        "Release": 2,
        "RecordDemand": 3,
        "MarkAdmissionFailed": 4,
        "SetPolicy": 5,
        "Found": 6,
        "Admit": 7,
        "Eligible": 8,
        "Verdict": 9,
    }
    assert (Assign, Release, MarkAdmissionFailed) == ASSIGNMENT_COMMANDS
    assert (Found, Admit, Eligible) == ELIGIBILITY_COMMANDS


# The bytes every build before this one wrote for these commands.
PINNED = [
    (
        Assign(N1, "qwen3", (0, 8), "bf16", "operator", False, 1, 1.0),
        "8901" + "5820" + "01" * 32 + "657177656e338200086462663136686f70657261746f72f401f93c00",
    ),
    (
        Assign(N2, "llama", (8, 16), "q4", "managed", True, 7, 1.7e9),
        "8901" + "5820" + "02" * 32 + "656c6c616d61820810627134676d616e61676564f507fa4ecaa7e2",
    ),
    (
        Release(N1, "qwen3", 1, "operator reload", 2.5),
        "8602" + "5820" + "01" * 32 + "657177656e33016f6f70657261746f722072656c6f6164f94100",
    ),
    (RecordDemand("qwen3", 3, 7.0), "8403657177656e3303f94700"),
    (
        MarkAdmissionFailed(N2, "llama", 4, 1e9),
        "8504" + "5820" + "02" * 32 + "656c6c616d6104fa4e6e6b28",
    ),
    (
        SetPolicy((("idle_release_s", 4.0), ("max_copies", 2)), 5.0),
        "830582826e69646c655f72656c656173655f73f94400826a6d61785f636f7069657302f94500",
    ),
    (Found(N1, "private", 0.5), "8406" + "5820" + "01" * 32 + "6770726976617465f93800"),
    (  # logged before invitations counted their uses: four fields, as then
        Admit(N2, True, b"\xab" * 32, 3.0),
        "8507" + "5820" + "02" * 32 + "f5" + "5820" + "ab" * 32 + "f94200",
    ),
    (Eligible(N2, 4.0), "8308" + "5820" + "02" * 32 + "f94400"),
    (
        Verdict(N1, N2, b"\xee" * 32, True, 1.7e9),
        "8609" + "5820" + "01" * 32 + "5820" + "02" * 32 + "5820" + "ee" * 32 + "f5fa4ecaa7e2",
    ),
]


# Added by this build: an admission that counts its invitation's uses (a
# fifth field, appended; the four-field form above still decodes as it did).
ADDED = [
    (
        Admit(N2, False, b"\xab" * 32, 3.0, 3),
        "8607" + "5820" + "02" * 32 + "f4" + "5820" + "ab" * 32 + "f94200" + "03",
    ),
]


@pytest.mark.parametrize(("command", "wire"), PINNED + ADDED, ids=lambda v: type(v).__name__)
def test_every_command_keeps_its_bytes_and_round_trips(command: Command, wire: str) -> None:
    data = encode_command(command)
    assert data.hex() == wire
    assert decode_command(data) == command


def test_an_admission_counts_its_invitations_uses_only_in_its_added_field() -> None:
    legacy = decode_command(bytes.fromhex(PINNED[7][1]))
    assert isinstance(legacy, Admit) and legacy.uses is None
    counted = encode_command(Admit(N2, True, b"\xab" * 32, 3.0, 1))
    assert counted[0] == 0x86 and decode_command(counted) == Admit(N2, True, b"\xab" * 32, 3.0, 1)
    # An explicit null for the added field is not the canonical form.
    null = cbor2.dumps([7, N2, True, b"\xab" * 32, 3.0, None], canonical=True)
    with pytest.raises(LedgerError, match="canonical"):
        decode_command(null)
    too_many = cbor2.dumps([7, N2, True, b"\xab" * 32, 3.0, 1, 1], canonical=True)
    with pytest.raises(LedgerError, match="takes 4 to 5 fields, got 6"):
        decode_command(too_many)


def test_every_command_type_is_pinned() -> None:
    assert {type(c) for c, _ in PINNED} == set(COMMAND_TYPE_IDS)


@pytest.mark.parametrize(
    "command",
    [
        assign(N1, "qwen3", 1, "operator"),
        Release(N1, "qwen3", 1, "operator reload", 2.5),
        RecordDemand("qwen3", 3, 7.0),
        MarkAdmissionFailed(N2, "llama", 4, 1e9),
        SetPolicy((("idle_release_s", 4.0), ("max_copies", 2)), 5.0),
        Verdict(N1, N2, b"\xee" * 32, True, 1.7e9),
        Verdict(N2, N1, b"\xee" * 32, False, 0.0),
    ],
)
def test_commands_round_trip_canonically(command: Command) -> None:
    data = encode_command(command)
    assert decode_command(data) == command
    assert encode_command(decode_command(data)) == data


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tier": "managed", "managed": False}, "contradicts"),
        ({"tier": "operator", "managed": True}, "contradicts"),
        ({"layers": (4, 4)}, "a < b"),
        ({"layers": (0, 1, 2)}, "pair"),
        ({"recipe": "int3"}, "one of"),
        ({"tier": "sudo"}, "one of"),
        ({"epoch": 0}, "epoch"),
        ({"epoch": True}, "epoch"),
        ({"node": b"short"}, "32 bytes"),
        ({"model": ""}, "non-empty"),
        ({"at": float("nan")}, "finite"),
        ({"managed": 1}, "bool"),
    ],
)
def test_invalid_assign_is_refused(kwargs: dict[str, object], match: str) -> None:
    base: dict[str, object] = {
        "node": N1,
        "model": "m",
        "layers": (0, 4),
        "recipe": "q4",
        "tier": "managed",
        "managed": True,
        "epoch": 1,
        "at": 0.0,
    }
    with pytest.raises(LedgerError, match=match):
        Assign(**(base | kwargs))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ((), "non-empty"),
        ((("sudo", 1.0),), "one of"),
        ((("idle_release_s",),), "pair"),
        ((("max_copies", 2), ("idle_release_s", 4.0)), "sorted"),
        ((("idle_release_s", 4.0), ("idle_release_s", 5.0)), "each once"),
        ((("max_copies", 2.0),), "max_copies must be an integer"),
        ((("max_copies", 0),), ">= 1"),
        ((("cooldown_s", -1.0),), ">= 0"),
        ((("cooldown_s", float("inf")),), "finite"),
        ((("cooldown_s", True),), "a number"),
        ((("max_copies", 2**63),), "magnitude"),
        ((("admission_backoff_s", 7200.0),), "ceiling"),
    ],
)
def test_invalid_policy_settings_are_refused(settings: tuple[object, ...], match: str) -> None:
    with pytest.raises(LedgerError, match=match):
        SetPolicy(settings, 0.0)  # type: ignore[arg-type]


def test_a_float_knob_given_an_int_has_one_encoding() -> None:
    command = SetPolicy((("idle_release_s", 4),), 0.0)
    assert command.settings == (("idle_release_s", 4.0),)
    assert type(command.settings[0][1]) is float
    # The same knob sent as an int on the wire is not the canonical form.
    with pytest.raises(LedgerError, match="canonical"):
        decode_command(cbor2.dumps([5, [["idle_release_s", 4]], 0.0], canonical=True))


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (cbor2.dumps([99, "x"]), "unknown command type 99"),
        (cbor2.dumps([True, "m", 1, 1.0]), "unknown command type"),
        (cbor2.dumps({"type": 3}), "non-empty CBOR array"),
        (cbor2.dumps([3, "m", 1]), "takes 3 fields"),
        (cbor2.dumps([3, 7, 1, 1.0]), "model must be"),
        (cbor2.dumps([3, "m", "1", 1.0]), "count must be"),
        (cbor2.dumps([3, "m", 1, 1]), "canonical"),  # an int where the float goes
        (encode_command(RecordDemand("m", 1, 1.0)) + b"\x00", "trailing_bytes"),
        (cbor2.dumps([3, "m", 1, cbor2.CBORTag(40000, 0)]), "tags"),
        (cbor2.dumps([3, "m", 1, cbor2.CBORTag(1, 0)]), "forbidden_tag"),  # a datetime tag too
        (b"\xff\xfe", "malformed"),
        (b"", "malformed"),
        (b"\x80" * (MAX_COMMAND_BYTES + 1), "cap"),
        (cbor2.dumps([1, [[[[[[[[[[1]]]]]]]]]]]), "too_deep"),
    ],
)
def test_decode_is_strict(data: bytes, match: str) -> None:
    with pytest.raises(LedgerError, match=match):
        decode_command(data)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"reporter": N1}, "cannot report itself"),
        ({"accused": b"short"}, "accused must be 32 bytes"),
        ({"reporter": "n2"}, "reporter must be 32 bytes"),
        ({"evidence": b"\x01" * 31}, "evidence must be 32 bytes"),
        ({"guilty": 1}, "guilty must be a bool"),
        ({"at": -1.0}, "finite number >= 0"),
        ({"at": float("inf")}, "finite"),
        ({"at": float("nan")}, "finite"),
    ],
)
def test_invalid_verdicts_are_refused(kwargs: dict[str, object], match: str) -> None:
    base: dict[str, object] = {
        "accused": N1,
        "reporter": N2,
        "evidence": evidence(1),
        "guilty": True,
        "at": 0.0,
    }
    with pytest.raises(LedgerError, match=match):
        Verdict(**(base | kwargs))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: Release(N1, "m", 0, "left", 0.0), "epoch"),
        (lambda: Release(N1, "m", 1, "", 0.0), "reason"),
        (lambda: Release(N1, "m", 1, "x" * (MAX_TEXT + 1), 0.0), "reason"),
        (lambda: RecordDemand("m", 0, 0.0), "count"),
        (lambda: RecordDemand("m", 1, float("inf")), "finite"),
        (lambda: MarkAdmissionFailed(b"short", "m", 1, 0.0), "32 bytes"),
        (lambda: Found(N1, "secret", 0.0), "one of"),
        (lambda: Found(b"", "open", 0.0), "32 bytes"),
        (lambda: Admit(N1, 1, b"\x00" * 32, 0.0), "bool"),
        (lambda: Admit(N1, True, b"\x00" * 31, 0.0), "invitation must be 32 bytes"),
        (lambda: Admit(N1, False, b"\x00" * 32, 0.0, 0), "uses must be"),
        (lambda: Admit(N1, False, b"\x00" * 32, 0.0, MAX_INVITATION_USES + 1), "uses must be"),
        (lambda: Admit(N1, True, b"\x00" * 32, 0.0, 2), "a voter's invitation admits one"),
        (lambda: Eligible(N1, float("nan")), "finite"),
    ],
)
def test_every_command_checks_its_fields(build: object, match: str) -> None:
    with pytest.raises(LedgerError, match=match):
        build()  # type: ignore[operator]


def test_an_int_where_a_time_goes_is_stored_as_the_float_it_encodes_as() -> None:
    command = Eligible(N1, 4)
    assert type(command.at) is float
    assert decode_command(encode_command(command)) == command


def test_strict_loads_takes_only_bytes_within_the_cap() -> None:
    assert strict_loads(cbor2.dumps([1, 2.5]), 16) == [1, 2.5]
    with pytest.raises(LedgerError, match="expected bytes"):
        strict_loads(bytearray(b"\x80"), 16)
    with pytest.raises(LedgerError, match="cap"):
        strict_loads(cbor2.dumps(list(range(20))), 16)
