"""The placement policy's settings (knobs): one set for the whole swarm.

Every knob is a number with a documented default. The swarm's values live in
the placement ledger (`consensus.commands.SetPolicy`): a leader decides with
the knobs every replica agrees on, so the swarm behaves the same whoever
leads, and a new leader does not quietly bring its own settings. An operator
changes them with `shardmesh policy --set NAME=VALUE`, which commits them.

`settings_error` is the one validation both the API (a 400 naming the field)
and the ledger (a rejected command) use, so a value the API accepts is one
the ledger applies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Final


@dataclass(frozen=True, slots=True)
class PlacementSettings:
    """Knobs and their defaults, each with why."""

    demand_window_s: float = 300.0
    """Demand-rate window and decay time constant (see the module doc). Five
    minutes smooths a chat user's bursts while a model abandoned for half an
    hour has decayed to e**-6 of its rate."""
    idle_release_s: float = 1800.0
    """A managed assignment whose model had no request (and no new placement)
    for this long is released. Loading a shard and passing doctor costs
    minutes; half an hour of silence is long enough that the capacity is
    worth more to the next model than the chance of the same user returning."""
    cooldown_s: float = 600.0
    """A managed assignment must be older than this before the safety policy
    may retarget it: a node that loaded a shard minutes ago has not repaid
    its load time, and demand that swings faster would make nodes thrash."""
    min_copies_left: int = 3
    """ADR-0026 / the Qwen PRD: a retarget leaves the old model at least this
    many admitted copies, so it still survives two failures."""
    retarget_demand_ratio: float = 1.5
    """ADR-0026: the new model's demand rate must be at least this multiple
    of the old one's; below it the gain does not repay a reload."""
    requests_per_copy_per_min: float = 20.0
    """One extra copy of a model per this many requests per minute. A chat
    answer of ~200 tokens at ~20 tokens/s holds a chain ~10 s; a chain that
    interleaves ~4 sessions serves ~24 requests a minute, 20 leaves headroom."""
    max_copies: int = 4
    """Copies placed for demand are capped so one hot model cannot take the
    whole spare pool from the next model to be asked for."""
    admission_backoff_s: float = 60.0
    """A node that failed doctor for a model is not offered that model again
    for this long after its first failure (doubling per further failure): a
    broken driver or a corrupt local copy does not fix itself in seconds."""
    max_admission_backoff_s: float = 3600.0
    """The back-off's ceiling: an hour, so a node whose operator fixed it is
    retried the same day without an operator having to intervene."""
    release_cooldown_s: float = 30.0
    """A node whose managed assignment was released rests this long before a
    new one, so it can unload and publish its model-less record, and so no
    node bounces between models on consecutive rounds."""
    dead_grace_s: float = 60.0
    """Membership must say "dead" this long before a managed assignment is
    released. SWIM already waited out suspicion; this covers a crash and
    restart, which reloads the same shard faster than a new node would."""

    verify_fraction: float = 0.25
    """The share of finished chat requests an entry spot-checks by replaying
    them on other nodes (`runtime.node.spot_check`). A liar caught by any
    checked request is quarantined, so an always-lying hop survives 1/f
    requests on average (p99: ln(100)/f, 18 at 0.25), and a check costs one
    prefill of the request's history: a few percent of what its decode
    steps cost (`python -m benchmarks.verify` measures both). 0 turns
    checking off; 1 checks everything."""

    def __post_init__(self) -> None:
        if not 0 <= self.verify_fraction <= 1:
            raise ValueError("verify_fraction must be in [0, 1]")
        if self.min_copies_left < 1 or self.max_copies < 1:
            raise ValueError("min_copies_left and max_copies must be >= 1")
        if self.retarget_demand_ratio < 1 or self.requests_per_copy_per_min <= 0:
            raise ValueError("need retarget_demand_ratio >= 1 and requests_per_copy_per_min > 0")
        durations = (
            self.demand_window_s,
            self.idle_release_s,
            self.cooldown_s,
            self.admission_backoff_s,
            self.max_admission_backoff_s,
            self.release_cooldown_s,
            self.dead_grace_s,
        )
        if min(durations) < 0 or self.demand_window_s == 0:
            raise ValueError("durations must be >= 0 and demand_window_s > 0")
        if self.admission_backoff_s > self.max_admission_backoff_s:
            raise ValueError(
                f"admission_backoff_s ({self.admission_backoff_s}) is above its ceiling "
                f"max_admission_backoff_s ({self.max_admission_backoff_s})"
            )


MAX_SETTING: Final = 2**63 - 1
"""Every setting fits CBOR's and sqlite's signed 64 bits (the ledger stores it)."""

POLICY_FIELDS: Final[Mapping[str, type]] = {
    f.name: int if f.type in ("int", int) else float for f in fields(PlacementSettings)
}
"""Each knob's name and number type (its annotation), in declaration order."""


def settings_error(settings: Mapping[str, object], base: PlacementSettings) -> str | None:
    """Why `settings` (knob name -> value) cannot be applied on top of
    `base`, or None when they can. Ints are knobs' counts; durations and
    ratios take any finite number (an int is read as a float)."""
    checked: dict[str, int | float] = {}
    for name, value in settings.items():
        kind = POLICY_FIELDS.get(name)
        if kind is None:
            return f"unknown policy setting {name!r}; known: {', '.join(POLICY_FIELDS)}"
        if type(value) is not int and (kind is int or type(value) is not float):
            return f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}"
        if not math.isfinite(value) or abs(value) > MAX_SETTING:
            return f"{name} must be a finite number of magnitude at most 2**63-1, got {value!r}"
        checked[name] = value
    try:
        with_settings(base, checked)
    except ValueError as exc:
        return str(exc)
    return None


def with_settings(
    base: PlacementSettings, settings: Mapping[str, int | float]
) -> PlacementSettings:
    """`base` with `settings` applied (valid ones: see `settings_error`)."""
    return replace(base, **{n: POLICY_FIELDS[n](v) for n, v in settings.items()})


def policy_json(policy: PlacementSettings) -> dict[str, int | float]:
    """Every knob by name, for status and the `policy` command."""
    return {name: getattr(policy, name) for name in POLICY_FIELDS}
