"""`shardmesh doctor`: does this machine compute a shard correctly (node admission)?

It runs the checks a node's admission runs (`runtime.model.doctor`): the
environment, the manifest, the shard's tensor digests, a real forward pass
of the probe against the golden activations, then throughput. Exit 0 only
when the shard is admitted; a refusal exits 1 saying which check failed.
"""

from __future__ import annotations

import argparse
import sys

from runtime.cli import argtypes
from runtime.cli.command import PROG, Commands, fail
from runtime.cli.model_source import (
    MODEL_METAVAR,
    ModelSourceError,
    fetch_model,
    fetch_weights,
    model_source,
    require_manifest,
)


def register(commands: Commands) -> None:
    doctor = commands.add_parser(
        "doctor",
        help="check that this machine computes a shard correctly (node admission)",
        description=(
            "Check the environment, the manifest, the shard's tensor digests and a real "
            "forward pass of the manifest's probe against its golden activations, then "
            "measure throughput. Exits 0 only when the shard is admitted."
        ),
    )
    doctor.add_argument(
        "--model",
        required=True,
        type=model_source,
        metavar=MODEL_METAVAR,
        help="model directory, or a Hugging Face Hub model (only the shard's weight files "
        "are fetched)",
    )
    doctor.add_argument(
        "--layers",
        required=True,
        type=argtypes.layer_span,
        metavar="A:B",
        help="the shard: layers A (inclusive) to B (exclusive)",
    )
    doctor.add_argument("--recipe", required=True, metavar="R", help="fp32, bf16, fp16, q8 or q4")
    doctor.add_argument(
        "--backend",
        choices=("torch", "mlx"),
        default=None,
        help="compute backend (default: mlx on Apple silicon, torch elsewhere)",
    )
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("--no-measure", action="store_true", help="skip the throughput measurement")
    doctor.set_defaults(run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from runtime.model.backends.base import BackendError  # the backends: only for a check
    from runtime.model.doctor import preflight, render_text, run_doctor
    from runtime.model.progress import Progress

    start, end = args.layers
    try:
        folder = fetch_model(args.model, "doctor")
        require_manifest(args.model, folder)
        if preflight(folder, start, end, args.recipe, args.backend).admitted:
            fetch_weights(args.model, "doctor", folder, args.layers)  # else the doctor says why
    except ModelSourceError as exc:
        return fail("doctor", f"--model: {exc}")
    except BackendError as exc:  # the hub could not give the model's files
        return fail("doctor", str(exc))
    with Progress(f"{PROG} doctor") as progress:
        report = run_doctor(
            folder,
            start,
            end,
            args.recipe,
            args.backend,
            measure=not args.no_measure,
            progress=progress,
        )
    print(report.to_json() if args.json else render_text(report))
    if not report.admitted:
        print(f"{PROG} doctor: refused: {report.reason}: {report.message}", file=sys.stderr)
        return 1
    return 0
