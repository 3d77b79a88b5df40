"""The data-plane vocabulary: messages round-trip, and every header field is checked."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mesh.wire import decode_tensor
from runtime.inference.protocol import (
    ENTRY_OPS,
    HOP_OPS,
    MAX_REASON_CHARS,
    OP_ERROR,
    R_BAD_FIELD,
    BadMessage,
    check_field,
    compute_us_field,
    encode_message,
    error_header,
    new_session_id,
    node_field,
    sampling_from_header,
    sampling_header,
    session_field,
    text_field,
    uint_field,
)
from runtime.model.sampling import SamplingParams


def test_a_message_round_trips_through_the_wire() -> None:
    inputs = np.arange(6, dtype=np.int64)
    frames = encode_message({"op": "forward", "session": new_session_id(), "step": 0}, inputs)
    header, dtype, shape, raw = decode_tensor(frames)
    assert header["op"] == "forward" and dtype == "int64" and shape == (6,)
    assert np.array_equal(np.frombuffer(raw, dtype=np.int64), inputs)
    empty = decode_tensor(encode_message({"op": "close", "session": new_session_id()}))
    assert (empty[1], empty[2]) == ("uint8", (0,)), "no payload: a 0-length uint8 tensor"


def test_session_ids_are_fresh_lowercase_hex() -> None:
    one, two = new_session_id(), new_session_id()
    assert one != two and len(one) == 32 and one == one.lower()
    assert session_field({"session": one}) == one


@pytest.mark.parametrize("bad", [None, "AB" * 16, "ab" * 15, "zz" * 16, 7])
def test_a_bad_session_id_is_a_bad_field(bad: object) -> None:
    with pytest.raises(BadMessage) as caught:
        session_field({"session": bad})
    assert caught.value.reason == R_BAD_FIELD


def test_integer_fields() -> None:
    assert uint_field({"step": 3}, "step") == 3
    for bad in (-1, True, 1.5, "3", None):
        with pytest.raises(BadMessage):
            uint_field({"step": bad}, "step")
    with pytest.raises(BadMessage):
        uint_field({"pos": 11}, "pos", high=10)


def test_compute_times_are_optional_and_checked() -> None:
    assert compute_us_field({}) == ()
    assert compute_us_field({"compute_us": [1, 20]}) == (1, 20)
    with pytest.raises(BadMessage):
        compute_us_field({"compute_us": [1, -2]})
    with pytest.raises(BadMessage):
        compute_us_field({"compute_us": list(range(1000))})


def test_a_spot_checks_open_names_what_to_judge() -> None:
    assert check_field({}, 10) is None
    assert check_field({"check": {"from": 2, "tokens": [5, 6]}}, 10) == (2, (5, 6))
    for bad in ({"from": 2}, {"from": 11, "tokens": [1]}, {"from": 0, "tokens": []}, [1]):
        with pytest.raises(BadMessage):
            check_field({"check": bad}, 10)
    with pytest.raises(BadMessage):
        check_field({"check": {"from": 0, "tokens": list(range(11))}}, 10)


def test_text_and_node_fields() -> None:
    assert text_field({"model": "tiny"}, "model", 10) == "tiny"
    for bad in ("", "x" * 11, 3):
        with pytest.raises(BadMessage):
            text_field({"model": bad}, "model", 10)
    assert node_field({"prev": "ab" * 32}, "prev") == bytes.fromhex("ab" * 32)
    with pytest.raises(BadMessage):
        node_field({"prev": "ab" * 31}, "prev")


def test_sampling_travels_to_the_last_hop_and_is_checked_there() -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=50)
    assert sampling_from_header(sampling_header(params)) == SamplingParams(
        temperature=0.7, top_p=0.9, top_k=50
    )
    bad: list[Any] = [
        {"temperature": 0.7},
        {"temperature": -1.0, "top_p": 0.9, "top_k": 50},
        "greedy",
    ]
    for value in bad:
        with pytest.raises(BadMessage):
            sampling_from_header(value)


def test_an_error_echoes_only_a_valid_step_and_bounds_its_reason() -> None:
    header = error_header("ab" * 16, -3, "bad_position", "x" * 1000)
    assert header["op"] == OP_ERROR and header["step"] is None
    assert len(header["reason"]) == MAX_REASON_CHARS
    assert error_header("ab" * 16, 4, "busy")["step"] == 4
    assert error_header("ab" * 16, 4, "budget", "over")["reason"] == "budget: over"


def test_the_two_sides_ops_do_not_overlap() -> None:
    assert not HOP_OPS & ENTRY_OPS
