"""The placement policy's knobs: one validation for the API and the ledger,
and the names and number types the ledger stores."""

from __future__ import annotations

import dataclasses

import pytest

from consensus.settings import (
    MAX_SETTING,
    POLICY_FIELDS,
    PlacementSettings,
    policy_json,
    settings_error,
    with_settings,
)


def test_every_knob_has_a_name_and_a_number_type_in_declaration_order() -> None:
    names = [f.name for f in dataclasses.fields(PlacementSettings)]
    assert list(POLICY_FIELDS) == names
    assert POLICY_FIELDS["max_copies"] is int and POLICY_FIELDS["min_copies_left"] is int
    assert POLICY_FIELDS["idle_release_s"] is float and POLICY_FIELDS["verify_fraction"] is float


@pytest.mark.parametrize(
    ("knobs", "match"),
    [
        ({"verify_fraction": 1.5}, r"verify_fraction must be in \[0, 1\]"),
        ({"max_copies": 0}, ">= 1"),
        ({"retarget_demand_ratio": 0.5}, "retarget_demand_ratio >= 1"),
        ({"requests_per_copy_per_min": 0.0}, "requests_per_copy_per_min > 0"),
        ({"cooldown_s": -1.0}, "durations must be >= 0"),
        ({"demand_window_s": 0.0}, "demand_window_s > 0"),
        ({"admission_backoff_s": 7200.0}, "above its ceiling"),
    ],
)
def test_settings_that_make_no_sense_are_refused(knobs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PlacementSettings(**knobs)
    assert settings_error(knobs, PlacementSettings()) is not None


@pytest.mark.parametrize(
    ("knobs", "match"),
    [
        ({"sudo": 1}, "unknown policy setting 'sudo'"),
        ({"max_copies": 2.0}, "max_copies must be an integer"),
        ({"cooldown_s": "10"}, "cooldown_s must be a number"),
        ({"cooldown_s": True}, "cooldown_s must be a number"),
        ({"cooldown_s": float("nan")}, "finite"),
        ({"max_copies": MAX_SETTING + 1}, "magnitude"),
    ],
)
def test_settings_error_says_why_a_value_cannot_be_applied(knobs: dict, match: str) -> None:
    error = settings_error(knobs, PlacementSettings())
    assert error is not None and match in error


def test_settings_are_checked_on_top_of_those_in_force() -> None:
    """A ceiling lowered below the back-off in force is refused; alone it is fine."""
    assert settings_error({"max_admission_backoff_s": 30.0}, PlacementSettings()) is not None
    low = PlacementSettings(admission_backoff_s=10.0)
    assert settings_error({"max_admission_backoff_s": 30.0}, low) is None


def test_an_int_for_a_float_knob_is_applied_as_a_float() -> None:
    assert settings_error({"idle_release_s": 60}, PlacementSettings()) is None
    policy = with_settings(PlacementSettings(), {"idle_release_s": 60, "max_copies": 2})
    assert type(policy.idle_release_s) is float and policy.idle_release_s == 60.0
    assert policy.max_copies == 2 and policy.cooldown_s == PlacementSettings().cooldown_s


def test_policy_json_names_every_knob() -> None:
    policy = PlacementSettings(max_copies=2)
    shown = policy_json(policy)
    assert list(shown) == list(POLICY_FIELDS) and shown["max_copies"] == 2
