"""`shardmesh simulate`: a TOML scenario run in the deterministic simulator.

One run prints its metrics (and with `--out` writes them with the traced
timeline and plots); `--seeds` or `--set` sweep a grid of seeds x settings
instead, one CSV row per run (`simulations.sweep`). Same seed, same results
and trace digest.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from runtime.cli import argtypes
from runtime.cli.command import Commands, fail


def register(commands: Commands) -> None:
    simulate = commands.add_parser(
        "simulate",
        help="run a scenario in the deterministic simulator",
        description=(
            "Run the real membership core on simulated nodes, links and faults described "
            "by a TOML scenario (examples: simulations/scenarios/); a scenario with a "
            "[placement] table runs demand placement on the real Raft and ledger instead. "
            "Same seed, same results and trace digest."
        ),
    )
    simulate.add_argument(
        "scenario", type=Path, nargs="?", metavar="SCENARIO.toml", help="the scenario"
    )
    simulate.add_argument(
        "--schema",
        action="store_true",
        help="print every key a scenario may hold (Markdown) and exit",
    )
    simulate.add_argument("--seed", type=int, default=1, help="run seed (default 1)")
    simulate.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help=(
            "also write metrics.json, timeline.txt (the traced events) and PNG plots "
            "(membership beliefs, traffic, record spread over time) into DIR"
        ),
    )
    simulate.add_argument("--json", action="store_true", help="print the metrics as JSON")
    _sweep_flags(simulate)
    simulate.set_defaults(run=run)


def _sweep_flags(simulate: argparse.ArgumentParser) -> None:
    sweep = simulate.add_argument_group(
        "sweeps", "run a grid of seeds x settings, one CSV row per run (simulations.sweep)"
    )
    sweep.add_argument("--seeds", metavar="A..B", help="seeds to sweep: 1..50, or 1,2,7")
    sweep.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="sweep a scenario key over values, e.g. membership.suspicion_mult=2,3,4 "
        "(repeatable: the grid is every combination)",
    )
    sweep.add_argument(
        "--jobs",
        type=argtypes.positive_int,
        default=1,
        help="runs in parallel processes (default 1)",
    )
    sweep.add_argument(
        "--csv", type=Path, metavar="FILE", help="write the sweep's rows here (default: stdout)"
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.schema:
        from simulations.schema import render_schema  # the simulator: only when it runs

        print(render_schema(), end="")
        return 0
    if args.scenario is None:
        return fail("simulate", "name a SCENARIO.toml (or --schema)", code=2)
    if not args.scenario.is_file():
        return fail("simulate", f"no scenario file at {args.scenario}")
    if args.seeds or args.set or args.csv:
        return simulate_sweep(args)
    return simulate_one(args)


def simulate_one(args: argparse.Namespace) -> int:
    """One seed: the metrics on stdout, and with `--out` the files."""
    import json

    from simulations.report import plots_unavailable  # the simulator: only when it runs
    from simulations.scenario import ScenarioError, run_scenario

    if not args.json:
        print(f"simulating {args.scenario} with seed {args.seed} ...", file=sys.stderr)
    timeline: list[str] | None = [] if args.out is not None else None
    plots = args.out
    if plots is not None and (why := plots_unavailable()) is not None:
        print(f"shardmesh simulate: warning: no plots: {why}", file=sys.stderr)
        plots = None
    try:
        result = run_scenario(args.scenario, args.seed, timeline, plots)
    except ScenarioError as exc:
        return fail("simulate", f"{args.scenario}: {exc}")
    document = json.dumps(result, indent=None if args.json else 2)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "metrics.json").write_text(document + "\n")
        lines = "".join(f"{line}\n" for line in timeline or ())
        (args.out / "timeline.txt").write_text(lines)
    print(document)
    return 0


def simulate_sweep(args: argparse.Namespace) -> int:
    """A grid of seeds x settings: one CSV row per run."""
    from simulations.schema import ScenarioError  # the simulator: only when it runs
    from simulations.sweep import Setting, parse_seeds, run_sweep, write_csv

    try:
        seeds = parse_seeds(args.seeds) if args.seeds else [args.seed]
        settings = [Setting.parse(text) for text in args.set]
        runs = len(seeds) * math.prod(len(s.values) for s in settings)
        print(
            f"sweeping {args.scenario}: {runs} runs on {args.jobs} process(es) ...", file=sys.stderr
        )
        rows = run_sweep(args.scenario, seeds, settings, jobs=args.jobs)
    except ScenarioError as exc:
        return fail("simulate", f"{args.scenario}: {exc}")
    write_csv(rows, args.csv if args.csv is not None else sys.stdout)
    if args.csv is not None:
        print(f"wrote {len(rows)} rows to {args.csv}", file=sys.stderr)
    return 0
