"""The scenario schema: every key a scenario file may hold, checked strictly.

A wrong experiment must not run: a misspelled key, a value of the wrong
type, a node that does not exist or a fault outside the run is an error
naming the key's path and what is allowed, before anything is simulated.
The schema is data (`SCENARIO`, `PLACEMENT`), so the same description
checks a file (`resolve`), renders the reference (`render_schema`, which is
`shardmesh simulate --schema` and `docs/simulation.md`) and cannot drift
from either.

`resolve` returns the scenario with every default filled in: what the run
actually used, which the metrics record beside the seed.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import math
import re
import textwrap
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from consensus.settings import POLICY_FIELDS, PlacementSettings, settings_error
from mesh.config import MembershipConfig
from mesh.records import RECIPES
from simulations.cluster import DEFAULT_RECORD_SIZE, DEFAULT_SEEDS, DEFAULT_STAGGER
from simulations.network import NetworkConfig


class ScenarioError(ValueError):
    """The scenario is wrong; the message names the key path and what is allowed."""


REQUIRED: Final = object()
"""The default of a key that has none: leaving it out is an error."""
PROFILE_DEFAULT: Final = object()
"""The default of an override key: whatever the named profile says."""
RUN_END: Final = object()
"""The default of a time that lasts until the run ends."""


@dataclass(frozen=True)
class Key:
    """One key of a table: its kind, what it means, and what it allows.

    kinds: number, integer, boolean, string, choice, strings (an array of
    strings), nodes (a node set), groups (node sets, or "halves"), voters
    (voter id sets, or "leader"), table (`keys`), tables (an array of tables
    with `keys`).
    """

    kind: str
    doc: str
    default: object = REQUIRED
    low: float | None = None
    high: float | None = None
    positive: bool = False
    choices: tuple[str, ...] = ()
    keys: Mapping[str, Key] = field(default_factory=dict)


def _number(doc: str, default: object = REQUIRED, **limits: Any) -> Key:
    return Key("number", doc, default, **limits)


def _integer(doc: str, default: object = REQUIRED, **limits: Any) -> Key:
    return Key("integer", doc, default, **limits)


def _field_docs(cls: type) -> dict[str, str]:
    """The first sentence of each field's docstring in `cls`'s source: the
    config classes document every field where it is declared."""
    docs = {}
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    for field_node, doc_node in itertools.pairwise(body.body):
        if (
            isinstance(field_node, ast.AnnAssign)
            and isinstance(field_node.target, ast.Name)
            and isinstance(doc_node, ast.Expr)
            and isinstance(doc_node.value, ast.Constant)
            and isinstance(doc_node.value.value, str)
        ):
            text = " ".join(doc_node.value.value.split())
            docs[field_node.target.id] = text.split(". ")[0].rstrip(".")
    return docs


def _overrides(
    cls: type, skip: frozenset[str], limits: Mapping[str, Mapping[str, Any]] | None = None
) -> dict[str, Key]:
    """A key per field of a config dataclass, defaulting to its profile's
    value, with the `limits` (Key's low, high, positive) given per field, so
    a wrong value is an error naming its key rather than the config's.

    An optional field (`float | None`) takes its kind: a scenario cannot
    write None, and leaving the key out keeps the profile's value."""
    docs = _field_docs(cls)
    hints = typing.get_type_hints(cls)
    kinds = {float: "number", int: "integer", bool: "boolean", str: "string"}
    keys = {}
    for item in dataclasses.fields(cls):
        if item.name in skip:
            continue
        doc = docs.get(item.name, f"the profile's `{item.name}`, overridden")
        hint = hints[item.name]
        given = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if isinstance(hint, types.UnionType) and len(given) == 1:
            hint = given[0]
        if typing.get_origin(hint) is typing.Literal:
            keys[item.name] = Key("choice", doc, PROFILE_DEFAULT, choices=typing.get_args(hint))
        elif hint in kinds:
            bounds = (limits or {}).get(item.name, {})
            keys[item.name] = Key(kinds[hint], doc, PROFILE_DEFAULT, **bounds)
        else:
            raise TypeError(f"{cls.__name__}.{item.name}: no scenario kind for {hint!r}")
    return keys


def _policy_keys() -> dict[str, Key]:
    """A key per placement policy knob, defaulting to the swarm's default;
    `settings_error` checks the values together (`_check_placement`), as
    the ledger does an operator's."""
    docs = _field_docs(PlacementSettings)
    defaults = PlacementSettings()
    kinds = {int: "integer", float: "number"}
    return {
        name: Key(kinds[kind], docs[name], getattr(defaults, name))
        for name, kind in POLICY_FIELDS.items()
    }


NETWORK_LIMITS: Final[dict[str, dict[str, Any]]] = {
    "base_latency": {"low": 0.0},
    "jitter": {"low": 0.0},
    "jitter_sigma": {"low": 0.0},
    "loss": {"low": 0.0, "high": 1.0},
    "duplicate": {"low": 0.0, "high": 1.0},
    "queue_capacity": {"low": 1},
    "service_time": {"low": 0.0},
    "bandwidth": {"positive": True},
}
"""What `NetworkConfig` accepts, per field, for `[network]` and its links
alike: the schema names the key of a wrong value, the config only the field."""

NETWORK_KEYS: Final = _overrides(NetworkConfig, frozenset(), NETWORK_LIMITS)
"""`[network]`'s overrides of its profile, one per `NetworkConfig` field."""

AT: Final = _number("when it happens, simulated seconds in [0, duration]", 0.0, low=0.0)
HEAL: Final = _number("when it ends: after `at`, at most `duration`", math.inf)
FLAP: Final = Key(
    "table",
    "repeat it from `at` to `heal` (which must be set): on for `duty` of every `period`",
    None,
    keys={
        "period": _number("seconds from one start to the next", positive=True),
        "duty": _number("the fraction of each period it is on", positive=True, high=1.0),
    },
)


def _groups(doc: str) -> Key:
    return Key("groups", doc)


FAULT_KEYS: Final[dict[str, dict[str, Key]]] = {
    "crash": {},
    "pause": {"duration": _number("seconds the node is frozen", 10.0, positive=True)},
    "restart": {},
    "leave": {},
    "publish": {},
    "skew": {
        "rate": _number(
            "seconds its clock counts per real second from `at` on: above 1 its timers "
            "fire early, below 1 late (1.0 sets it right after an earlier skew)",
            1.0,
            positive=True,
        ),
        "jump": _number(
            "seconds its clock leaps forward at `at` (a VM pause, a clock step): "
            "every timer due in between fires at once",
            0.0,
            low=0.0,
        ),
    },
    "partition": {
        "groups": Key(
            "groups",
            'node sets that can only reach their own set ("halves", or e.g. '
            "[[0, 1], [{range = [2, 50]}]]); nodes in no set form one more",
            "halves",
        ),
        "heal": HEAL,
        "flap": FLAP,
    },
    "cut": {
        "from": Key("nodes", "nodes whose messages are lost on the way..."),
        "to": Key("nodes", "...to these nodes (one way: `to` still reaches `from`)"),
        "heal": HEAL,
        "flap": FLAP,
    },
    "bridge": {
        "groups": _groups(
            "node sets that cannot reach each other; nodes in no set are the "
            "bridge, which reaches every set"
        ),
        "heal": HEAL,
        "flap": FLAP,
    },
    "ring": {
        "groups": _groups(
            "at least 4 node sets in a ring: each reaches only itself and its two "
            "neighbours; nodes in no set reach everyone"
        ),
        "heal": HEAL,
        "flap": FLAP,
    },
}
"""Per fault kind, the keys beside `kind` and `at`; the node faults also
name their targets with exactly one of `node`, `nodes` or `random`."""
LINK_FAULTS: Final = frozenset({"partition", "cut", "bridge", "ring"})
MIN_GROUPS: Final = {"bridge": 2, "ring": 4}
"""A bridge joins at least two sets; a ring of three is no ring (every set
is every other's neighbour), so a ring needs four."""
"""Faults of the network between nodes, not of nodes: they name no targets."""

TARGETS: Final = {
    "node": _integer("one node id", low=0),
    "nodes": Key("nodes", "node ids and ranges, e.g. [1, 2, {range = [10, 20]}]"),
    "random": _integer("this many nodes, a seeded pick sparing node 0", low=1),
}

PLACEMENT_FAULT_KEYS: Final[dict[str, dict[str, Key]]] = {
    "crash": {"worker": _integer("the worker's number", low=0)},
    "restart": {"worker": _integer("the worker's number", low=0)},
    "partition": {
        "voters": Key(
            "voters",
            'voter id sets that can only reach their own set, or "leader": '
            "whoever leads at `at`, alone; none: the voters stay together",
            None,
        ),
        "workers": Key(
            "nodes",
            'membership = "swim" only: worker numbers cut off on a side of their own; the '
            "other workers and the entries stay with the largest voter set",
            None,
        ),
        "heal": HEAL,
    },
}

SCENARIO: Final[dict[str, Key]] = {
    "name": Key("string", "the scenario's name, reported in the metrics", ""),
    "duration": _number("simulated seconds the run lasts", 60.0, positive=True),
    "nodes": Key(
        "table",
        "the swarm (membership scenarios)",
        keys={
            "count": _integer("how many nodes", low=1),
            "join": Key(
                "choice",
                "preconverged: everyone knows everyone at t=0; seed: all join via node 0",
                "preconverged",
                choices=("preconverged", "seed"),
            ),
            "seeds": _integer("how many nodes joiners contact", DEFAULT_SEEDS, low=1),
            "stagger": _number("seconds between two joins", DEFAULT_STAGGER, low=0.0),
            "record_size": _integer("bytes of each node record", DEFAULT_RECORD_SIZE, low=0),
        },
    ),
    "membership": Key(
        "table",
        "the membership configuration: a profile, then field overrides",
        {},
        keys={
            "profile": Key("choice", "named defaults", "lan", choices=("lan", "wan", "local")),
            **_overrides(MembershipConfig, frozenset({"name"})),
        },
    ),
    "network": Key(
        "table",
        "the simulated network: a profile, then field overrides",
        {},
        keys={
            "profile": Key("choice", "named defaults", "lan", choices=("lan", "wan")),
            **NETWORK_KEYS,
            "links": Key(
                "tables",
                "links unlike the rest: their own latency, loss and bandwidth",
                [],
                keys={
                    "from": Key("nodes", "the links from these nodes..."),
                    "to": Key("nodes", "...to these nodes"),
                    "both": Key("boolean", "also the links back, from `to` to `from`", True),
                    "base_latency": _number(
                        "their fixed one-way delay",
                        PROFILE_DEFAULT,
                        **NETWORK_LIMITS["base_latency"],
                    ),
                    "jitter": _number(
                        "their random delay's scale (lognormal: its median)",
                        PROFILE_DEFAULT,
                        **NETWORK_LIMITS["jitter"],
                    ),
                    "jitter_kind": Key(
                        "choice",
                        "how their random delay is drawn (lognormal: a long tail)",
                        PROFILE_DEFAULT,
                        choices=NETWORK_KEYS["jitter_kind"].choices,
                    ),
                    "jitter_sigma": _number(
                        "the shape of their lognormal delay",
                        PROFILE_DEFAULT,
                        **NETWORK_LIMITS["jitter_sigma"],
                    ),
                    "loss": _number(
                        "their loss probability", PROFILE_DEFAULT, **NETWORK_LIMITS["loss"]
                    ),
                    "bandwidth": _number(
                        "their bytes per second (unlimited unless this or `network.bandwidth` "
                        "is set)",
                        PROFILE_DEFAULT,
                        **NETWORK_LIMITS["bandwidth"],
                    ),
                },
            ),
        },
    ),
    "faults": Key("tables", "the fault schedule; see the fault kinds below", []),
}

PLACEMENT: Final[dict[str, Key]] = {
    "voters": _integer("Raft voters", 3, low=1, high=9),
    "detect_s": _number("seconds from a crash to `dead` at the leader", 10.0, positive=True),
    "membership": Key(
        "choice",
        "how the leader learns a worker died: oracle, `detect_s` after its crash; swim, "
        "from its own core of real SWIM on voters, workers and entries",
        "oracle",
        choices=("oracle", "swim"),
    ),
    "swim": Key(
        "table",
        'membership = "swim": its configuration, a profile then field overrides '
        "(the keys of [membership])",
        None,
        keys=SCENARIO["membership"].keys,
    ),
    "models": Key(
        "tables",
        "the models that may be asked for",
        [],
        keys={
            "name": Key("string", "the model's name"),
            "layers": _integer("its layer count", low=1),
            "layer_gb": _number("GB per layer", positive=True),
            "recipe": Key("choice", "its recipe", "bf16", choices=tuple(sorted(RECIPES))),
        },
    ),
    "workers": Key(
        "tables",
        "nodes that may serve, numbered in order (a count of n takes n numbers)",
        [],
        keys={
            "count": _integer("how many such workers", 1, low=1),
            "memory_gb": _number("memory for shards", positive=True),
            "models": Key("strings", "what its store holds", []),
            "pinned": Key("string", "a model its operator pinned it to (whole model)", None),
            "hardware": Key(
                "choice", "how fast it loads a shard", "gpu", choices=("gpu", "mac", "cpu")
            ),
            "fails_doctor": Key("boolean", "its copy is corrupt: every doctor fails", False),
            "lies": Key(
                "table",
                "it returns wrong outputs, e.g. `{rate = 0.01, from_s = 120.0}`; entries "
                "spot-check answers (`placement.policy.verify_fraction`)",
                None,
                keys={
                    "from_s": _number("when it starts lying, simulated seconds", 0.0, low=0.0),
                    "rate": _number(
                        "the fraction of its decode steps it lies on", positive=True, high=1.0
                    ),
                },
            ),
        },
    ),
    "demand": Key(
        "tables",
        "chat demand, Poisson per model",
        [],
        keys={
            "model": Key("string", "a model of [[placement.models]]"),
            "per_minute": _number("requests per minute", positive=True),
            "from": _number("when it starts", 0.0, low=0.0),
            "until": _number("when it stops", RUN_END, low=0.0),
        },
    ),
    "policy": Key(
        "table",
        "the placement policy's knobs (`consensus.settings`), as an operator sets them",
        {},
        keys=_policy_keys(),
    ),
}
"""The `[placement]` table: a placement scenario has it and no [nodes],
[membership] or [network] (placement runs its own cost model)."""


# --- resolving ----------------------------------------------------------------


def resolve(scenario: Mapping[str, Any]) -> dict[str, Any]:
    """`scenario` checked against the schema, every default filled in."""
    if not isinstance(scenario, Mapping):
        raise ScenarioError("a scenario is a table of keys")
    top = dict(SCENARIO)
    placement = "placement" in scenario
    if placement:
        for unused in ("nodes", "membership", "network"):
            if unused in scenario:
                raise ScenarioError(
                    f"[{unused}] is not used by placement scenarios (they have [placement])"
                )
            del top[unused]
        top["placement"] = Key("table", "a placement scenario", keys=PLACEMENT)
    resolved = _table(scenario, top, "")
    duration = resolved["duration"]
    if placement:
        _check_placement(resolved, duration, scenario["placement"])
    else:
        count = resolved["nodes"]["count"]
        for i, link in enumerate(resolved["network"]["links"]):
            for end in ("from", "to"):
                link[end] = node_set(link[end], count, f"network.links[{i}].{end}")
        resolved["faults"] = [
            _fault(fault, f"faults[{i}]", resolved["nodes"]["count"], duration)
            for i, fault in enumerate(scenario.get("faults", []))
        ]
    return resolved


def _table(value: object, keys: Mapping[str, Key], path: str) -> dict[str, Any]:
    where = path or "the scenario"
    if not isinstance(value, Mapping):
        raise ScenarioError(f"{where} must be a table")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        allowed = ", ".join(keys) or "nothing"
        raise ScenarioError(f"{_join(path, unknown[0])}: unknown key; {where} allows {allowed}")
    resolved = {}
    for name, key in keys.items():
        key_path = _join(path, name)
        if name in value:
            resolved[name] = _value(value[name], key, key_path)
        elif key.default is REQUIRED:
            raise ScenarioError(f"{key_path}: required ({key.doc})")
        elif key.kind == "table" and isinstance(key.default, Mapping):
            # An absent table is an empty one, with its defaults.
            resolved[name] = _table({}, key.keys, key_path)
        elif key.default is not PROFILE_DEFAULT:
            resolved[name] = key.default
    return resolved


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _value(value: object, key: Key, path: str) -> Any:
    check = _CHECKS.get(key.kind)
    return check(value, key, path) if check else value


def _check_number(value: object, key: Key, path: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ScenarioError(f"{path}: {value!r} is not a number")
    return _in_range(float(value), key, path)


def _check_integer(value: object, key: Key, path: str) -> int:
    if type(value) is not int:
        raise ScenarioError(f"{path}: {value!r} is not an integer")
    return int(_in_range(value, key, path))


def _in_range(value: float, key: Key, path: str) -> float:
    if math.isnan(value) or (key.positive and value <= 0):
        raise ScenarioError(f"{path}: {value!r} must be positive")
    if (key.low is not None and value < key.low) or (key.high is not None and value > key.high):
        raise ScenarioError(f"{path}: {value!r} is not in {_interval(key)}")
    return value


def _interval(key: Key) -> str:
    """The values `key` allows, e.g. [0.0, 1.0] or (0, 1.0]."""
    low = f"[{key.low}" if key.low is not None else "(0" if key.positive else "(-inf"
    high = f"{key.high}]" if key.high is not None else "inf)"
    return f"{low}, {high}"


def _check_boolean(value: object, key: Key, path: str) -> bool:
    if type(value) is not bool:
        raise ScenarioError(f"{path}: {value!r} is not true or false")
    return value


def _check_string(value: object, key: Key, path: str) -> str:
    if type(value) is not str:
        raise ScenarioError(f"{path}: {value!r} is not a string")
    return value


def _check_choice(value: object, key: Key, path: str) -> str:
    if value not in key.choices:
        raise ScenarioError(f"{path}: {value!r} is not one of {', '.join(key.choices)}")
    return str(value)


def _check_strings(value: object, key: Key, path: str) -> list[str]:
    if not isinstance(value, list):
        raise ScenarioError(f"{path}: must be an array of strings")
    return [_check_string(item, key, f"{path}[{i}]") for i, item in enumerate(value)]


def _check_tables(value: object, key: Key, path: str) -> list[Any]:
    if not isinstance(value, list) or not all(isinstance(item, Mapping) for item in value):
        raise ScenarioError(f"{path} must be an array of tables ([[{path}]])")
    if not key.keys:  # checked by its owner (faults depend on their kind)
        return list(value)
    return [_table(item, key.keys, f"{path}[{i}]") for i, item in enumerate(value)]


_CHECKS: Final[dict[str, Callable[[object, Key, str], Any]]] = {
    "number": _check_number,
    "integer": _check_integer,
    "boolean": _check_boolean,
    "string": _check_string,
    "choice": _check_choice,
    "strings": _check_strings,
    "tables": _check_tables,
    "table": lambda value, key, path: _table(value, key.keys, path),
}

_DASHED_RANGE = re.compile(r"\s*(\d+)\s*-\s*(\d+)\s*")


def node_set(value: object, count: int, path: str, what: str = "node") -> list[int]:
    """Ids from `[id, {range = [a, b]}, ...]` (b excluded), each in 0..count-1."""
    if not isinstance(value, list):
        raise ScenarioError(f"{path}: must be an array of {what} ids and {{range = [a, b]}}")
    ids: list[int] = []
    for i, item in enumerate(value):
        where = f"{path}[{i}]"
        if isinstance(item, Mapping):
            ids.extend(_range(item, count, where, what))
            continue
        ids.append(_member(item, count, where, what))
    return ids


def _member(item: object, count: int, path: str, what: str) -> int:
    if type(item) is not int:
        dashed = _DASHED_RANGE.fullmatch(item) if isinstance(item, str) else None
        hint = f"; use {{range = [{dashed[1]}, {int(dashed[2]) + 1}]}}" if dashed else ""
        raise ScenarioError(f"{path}: {item!r} is not a {what} id{hint}")
    if not 0 <= item < count:
        raise ScenarioError(f"{path}: {what} {item} is not in 0..{count - 1}")
    return item


def _range(item: Mapping[str, Any], count: int, path: str, what: str) -> list[int]:
    bounds = item.get("range")
    if set(item) != {"range"} or not isinstance(bounds, list) or len(bounds) != 2:
        raise ScenarioError(f"{path}: a range is {{range = [first, end]}} (end excluded)")
    first, end = (_member(b, count + 1, f"{path}.range", what) for b in bounds)
    if first >= end:
        raise ScenarioError(f"{path}.range: [{first}, {end}] is empty (end is excluded)")
    return list(range(first, end))


def _times(fault: dict[str, Any], path: str, duration: float) -> None:
    if fault["at"] > duration:
        raise ScenarioError(f"{path}.at: {fault['at']} is after the run ends ({duration})")
    heal = fault.get("heal")
    if heal is not None and not (fault["at"] < heal and (heal <= duration or heal == math.inf)):
        raise ScenarioError(
            f"{path}.heal: {heal} must be after `at` ({fault['at']}) and at most {duration}"
        )


def _fault_keys(fault: object, path: str, per_kind: Mapping[str, Mapping[str, Key]]) -> Any:
    if not isinstance(fault, Mapping):
        raise ScenarioError(f"{path} must be a table")
    kind = fault.get("kind")
    if kind not in per_kind:
        raise ScenarioError(f"{path}.kind: kind must be one of {', '.join(per_kind)}")
    return kind


def _fault(fault: object, path: str, count: int, duration: float) -> dict[str, Any]:
    kind = _fault_keys(fault, path, FAULT_KEYS)
    assert isinstance(fault, Mapping)
    keys = {"kind": Key("choice", "", choices=tuple(FAULT_KEYS)), "at": AT, **FAULT_KEYS[kind]}
    if kind not in LINK_FAULTS:
        named = [name for name in TARGETS if name in fault]
        if len(named) != 1:
            raise ScenarioError(f"{path}: say which node(s) with one of node, nodes or random")
        keys[named[0]] = TARGETS[named[0]]
    if kind == "skew" and not {"rate", "jump"} & set(fault):
        raise ScenarioError(f"{path}: a skew needs a `rate`, a `jump` or both")
    resolved = _table(fault, keys, path)
    _times(resolved, path, duration)
    if "node" in resolved:
        resolved["node"] = _member(resolved["node"], count, f"{path}.node", "node")
    for name in ("nodes", "from", "to"):
        if name in resolved:
            resolved[name] = node_set(resolved[name], count, f"{path}.{name}")
    if "random" in resolved and resolved["random"] > count - 1:
        raise ScenarioError(
            f"{path}.random: {resolved['random']} is more than the {count - 1} nodes besides 0"
        )
    if "groups" in resolved and resolved["groups"] != "halves":
        resolved["groups"] = _node_groups(resolved["groups"], kind, count, f"{path}.groups")
    if resolved.get("flap") is not None and resolved["heal"] == math.inf:
        raise ScenarioError(f"{path}.flap: a flapping fault needs a `heal` time to stop")
    return resolved


def _node_groups(groups: object, kind: str, count: int, path: str) -> list[list[int]]:
    if not isinstance(groups, list):
        halves = '"halves" or ' if kind == "partition" else ""
        raise ScenarioError(f"{path}: {halves}an array of node sets")
    sets = [node_set(group, count, f"{path}[{i}]") for i, group in enumerate(groups)]
    needed = MIN_GROUPS.get(kind, 1)
    if len(sets) < needed:
        raise ScenarioError(f"{path}: a {kind} needs at least {needed} node sets")
    seen: dict[int, int] = {}
    for i, group in enumerate(sets):
        for node in group:
            if seen.setdefault(node, i) != i:
                raise ScenarioError(f"{path}[{i}]: node {node} is already in set {seen[node]}")
    return sets


def _check_placement(resolved: dict[str, Any], duration: float, written: Mapping[str, Any]) -> None:
    """The placement checks one key cannot make alone; `written` is the
    `[placement]` table as the file has it (a key given that its choices
    leave unused is a mistake, even at its default value)."""
    placement = resolved["placement"]
    swim = placement["membership"] == "swim"
    _check_membership(placement, written)
    models = {model["name"] for model in placement["models"]}
    workers = sum(worker["count"] for worker in placement["workers"])
    for i, worker in enumerate(placement["workers"]):
        for name in (*worker["models"], *([worker["pinned"]] if worker["pinned"] else [])):
            if name not in models:
                raise ScenarioError(
                    f"placement.workers[{i}]: a worker names model {name!r}, "
                    "not in [[placement.models]]"
                )
        lies = worker["lies"]
        if lies is not None and lies["from_s"] >= duration:
            raise ScenarioError(
                f"placement.workers[{i}].lies.from_s: {lies['from_s']} is not before "
                f"the run ends ({duration}): it would never lie"
            )
    problem = settings_error(placement["policy"], PlacementSettings())
    if problem is not None:
        raise ScenarioError(f"placement.policy: {problem}")
    for i, demand in enumerate(placement["demand"]):
        if demand["model"] not in models:
            raise ScenarioError(f"placement.demand[{i}].model: {demand['model']!r} is not a model")
        if demand["until"] is RUN_END:
            demand["until"] = duration
    faults = []
    for i, fault in enumerate(resolved["faults"]):
        path = f"faults[{i}]"
        kind = _fault_keys(fault, path, PLACEMENT_FAULT_KEYS)
        keys = {"kind": Key("choice", "", choices=tuple(PLACEMENT_FAULT_KEYS)), "at": AT}
        done = _table(fault, keys | PLACEMENT_FAULT_KEYS[kind], path)
        _times(done, path, duration)
        if "worker" in done:
            done["worker"] = _member(done["worker"], workers, f"{path}.worker", "worker")
            faults.append(done)
            continue
        if done["workers"] is not None:
            if not swim:
                raise ScenarioError(
                    f'{path}.workers: cutting workers off needs placement.membership = "swim"'
                )
            done["workers"] = node_set(done["workers"], workers, f"{path}.workers", "worker")
        if not done["voters"] and not done["workers"]:
            raise ScenarioError(f"{path}: a partition names `voters`, `workers` or both")
        if done["voters"] not in (None, "leader"):
            voters = done["voters"]
            if not isinstance(voters, list):
                raise ScenarioError(f'{path}.voters: "leader" or an array of voter id sets')
            count = placement["voters"]
            done["voters"] = [
                node_set(g, count, f"{path}.voters[{j}]", "voter") for j, g in enumerate(voters)
            ]
        faults.append(done)
    resolved["faults"] = faults


def _check_membership(placement: dict[str, Any], written: Mapping[str, Any]) -> None:
    """`placement.swim` only with SWIM, `placement.detect_s` only without,
    and a SWIM configuration that `MembershipConfig` accepts."""
    if placement["membership"] == "oracle":
        if placement["swim"] is not None:
            raise ScenarioError('placement.swim: only used with placement.membership = "swim"')
        return
    if "detect_s" in written:
        raise ScenarioError(
            'placement.detect_s: unused with placement.membership = "swim" (the leader\'s '
            "own SWIM core detects crashes)"
        )
    try:
        swim_config(placement["swim"])
    except ValueError as exc:  # a value the config itself refuses
        raise ScenarioError(f"placement.swim: {exc}") from None


def swim_config(table: Mapping[str, Any] | None) -> MembershipConfig:
    """The membership configuration a resolved `[membership]` or
    `placement.swim` table describes: its profile, then its overrides
    (None: the LAN profile)."""
    overrides = dict(table or {"profile": "lan"})
    return MembershipConfig.profile(overrides.pop("profile")).with_overrides(**overrides)


# --- the reference ------------------------------------------------------------


def render_schema() -> str:
    """The schema as Markdown (`shardmesh simulate --schema`, docs/simulation.md)."""
    lines = ["## Top level (every scenario)", ""]
    lines += _rows(SCENARIO, "")
    lines += ["", "## Fault kinds (`[[faults]]`, membership scenarios)", ""]
    node_faults = ", ".join(f"`{kind}`" for kind in FAULT_KEYS if kind not in LINK_FAULTS)
    lines.append(f"Every fault has `kind` and `at`. The node faults ({node_faults}) name")
    lines.append("their targets with exactly one of:")
    lines.append("")
    lines += _rows(TARGETS, "faults[]")
    for kind, keys in FAULT_KEYS.items():
        lines += ["", f"### `{kind}`", ""]
        lines += (
            _rows(keys, "faults[]") if keys else ["No keys besides `kind`, `at` and the targets."]
        )
    lines += ["", "## `[placement]` (placement scenarios)", ""]
    lines.append("A placement scenario has `[placement]` and no `[nodes]`, `[membership]` or")
    lines.append("`[network]`.")
    lines.append("")
    lines += _rows(PLACEMENT, "placement")
    for kind, keys in PLACEMENT_FAULT_KEYS.items():
        lines += ["", f"### placement fault `{kind}`", ""]
        lines += _rows(keys, "faults[]")
    return "\n".join(lines) + "\n"


def _rows(keys: Mapping[str, Key], path: str) -> list[str]:
    rows = ["| key | kind | default | meaning |", "|---|---|---|---|"]
    nested = []
    for name, key in keys.items():
        full = _join(path, name)
        rows.append(f"| `{full}` | {_kind(key)} | {_default(key)} | {key.doc} |")
        if key.keys:
            nested.append((full, key))
    for full, key in nested:
        suffix = "[]" if key.kind == "tables" else ""
        rows += ["", f"### `{full}`", ""]
        rows += _rows(key.keys, full + suffix)
    return rows


def _kind(key: Key) -> str:
    if key.choices:
        return " \\| ".join(f"`{choice}`" for choice in key.choices)
    limits = []
    if key.positive:
        limits.append("> 0")
    if key.low is not None:
        limits.append(f">= {key.low:g}")
    if key.high is not None:
        limits.append(f"<= {key.high:g}")
    return key.kind + (f" ({', '.join(limits)})" if limits else "")


def _default(key: Key) -> str:
    if key.default is REQUIRED:
        return "required"
    if key.default is PROFILE_DEFAULT:
        return "the profile's"
    if key.default is RUN_END:
        return "the run's end"
    if key.default is None:
        return "none"
    if isinstance(key.default, bool):
        return f"`{str(key.default).lower()}`"
    if key.default == math.inf:
        return "never"
    if key.kind in ("table", "tables"):
        return "—"
    return f"`{key.default!r}`".replace("'", '"')
