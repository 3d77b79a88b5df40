"""Sweeps: one scenario run over a grid of seeds and settings, one CSV row per run.

    shardmesh simulate SCENARIO.toml --seeds 1..10 \
        --set membership.suspicion_mult=2,3,4 --jobs 2 --csv out.csv

The grid is every seed times every combination of the `--set` values
(settings vary slowest, seeds fastest), and rows come back in grid order
whatever `jobs` is. Each run is an ordinary `run_scenario` in a worker
process, so a row equals that one run alone. From Python: `run_sweep` and
`write_csv` (docs/simulation.md, "Sweeps" and "From Python").
"""

from __future__ import annotations

import copy
import csv
import itertools
import json
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

from simulations.scenario import load_scenario, run_scenario
from simulations.schema import ScenarioError, resolve

MAX_RUNS: Final = 100_000
"""A grid larger than this is almost certainly a typo in `--seeds`."""
SKIPPED: Final = frozenset({"provenance.resolved"})
"""Columns left out of a row: the resolved scenario is the same in every row
but for the swept keys, which have their own columns."""


@dataclass(frozen=True)
class Setting:
    """One swept key: its dotted path in the scenario and the values it takes."""

    path: str
    values: tuple[Any, ...]

    @classmethod
    def parse(cls, text: str) -> Setting:
        """`membership.suspicion_mult=2,3,4`: values are TOML (numbers,
        booleans, "quoted strings"); bare words are taken as strings."""
        path, sep, values = text.partition("=")
        if not sep or not path.strip() or not values.strip():
            raise ScenarioError(f"--set {text!r}: use KEY.PATH=VALUE[,VALUE...]")
        return cls(path.strip(), tuple(_toml_value(v.strip()) for v in values.split(",")))


def _toml_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_seeds(text: str) -> list[int]:
    """`1..50` (inclusive) or `1,2,7`."""
    try:
        if ".." in text:
            first, last = (int(part) for part in text.split("..", 1))
            seeds = list(range(first, last + 1))
        else:
            seeds = [int(part) for part in text.split(",")]
    except ValueError:
        raise ScenarioError(f"--seeds {text!r}: use FIRST..LAST or a list like 1,2,7") from None
    if not seeds:
        raise ScenarioError(f"--seeds {text!r} names no seed")
    return seeds


def with_setting(scenario: Mapping[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of `scenario` with the dotted `path` set to `value` (tables are
    created as needed; the schema then checks the result like any file)."""
    changed = copy.deepcopy(dict(scenario))
    table = changed
    *parents, leaf = path.split(".")
    for name in parents:
        inner = table.setdefault(name, {})
        if not isinstance(inner, dict):
            raise ScenarioError(f"--set {path}: {name} is not a table")
        table = inner
    table[leaf] = value
    return changed


def grid(seeds: Iterable[int], settings: Sequence[Setting]) -> list[tuple[int, dict[str, Any]]]:
    """Every (seed, {path: value}) of the sweep, in row order."""
    combos = itertools.product(*(s.values for s in settings))
    runs = [
        (seed, {s.path: value for s, value in zip(settings, combo, strict=True)})
        for combo in combos
        for seed in seeds
    ]
    if len(runs) > MAX_RUNS:
        raise ScenarioError(f"the sweep has {len(runs)} runs; at most {MAX_RUNS}")
    return runs


def run_sweep(
    source: str | Path | Mapping[str, Any],
    seeds: Iterable[int],
    settings: Sequence[Setting] = (),
    jobs: int = 1,
) -> list[dict[str, Any]]:
    """One row per run of the grid, in grid order: the seed, each swept
    value, then every metric (nested keys joined with dots; lists as JSON)."""
    base = load_scenario(source)
    runs = grid(list(seeds), settings)
    scenarios = []
    for _, values in runs:
        scenario = base
        for path, value in values.items():
            scenario = with_setting(scenario, path, value)
        resolve(scenario)  # every bad setting fails here, before any run starts
        scenarios.append(scenario)
    seeds_in_order = [seed for seed, _ in runs]
    if jobs <= 1:
        results = list(map(run_scenario, scenarios, seeds_in_order))
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(run_scenario, scenarios, seeds_in_order))
    return [
        {"seed": seed, **values, **_flat(result)}
        for (seed, values), result in zip(runs, results, strict=True)
    ]


def _flat(value: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    row: dict[str, Any] = {}
    for key, inner in value.items():
        name = f"{prefix}{key}"
        if name in SKIPPED:
            continue
        if isinstance(inner, Mapping):
            row.update(_flat(inner, f"{name}."))
        elif isinstance(inner, list):
            row[name] = json.dumps(inner, sort_keys=True)
        else:
            row[name] = inner
    return row


def write_csv(rows: Sequence[Mapping[str, Any]], target: str | Path | IO[str]) -> None:
    """The rows as CSV: the first row's columns in order, then any others."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    if isinstance(target, str | Path):
        with open(target, "w", newline="") as handle:
            _write(rows, columns, handle)
    else:
        _write(rows, columns, target)


def _write(rows: Sequence[Mapping[str, Any]], columns: list[str], handle: IO[str]) -> None:
    writer = csv.DictWriter(handle, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
