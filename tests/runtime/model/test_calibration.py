"""Calibrated admission on the tiny models: the manifest records every span's
honest error per recipe and probe token, the doctor judges against it, and
a manifest built before calibration keeps its identity and its old rule.

tests/runtime/model/test_pretrained.py shows why on a pretrained model (its massive
activations are what the per-model, per-token rule is for) and that the
margin separates honest shards from corrupted ones there."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from runtime.model.doctor import DoctorReport, run_doctor
from runtime.model.manifest import (
    GOLDEN_FILE,
    MANIFEST_FILE,
    PROBE_LENGTH,
    build_manifest,
    load_golden,
    load_manifest,
    manifest_digest,
)
from runtime.model.progress import Progress
from runtime.model.recipes import (
    CALIBRATION_MARGIN,
    RECIPES,
    calibrated_tolerance,
)
from runtime.model.tiny import make_tiny_model

LAYERS = 8  # runtime_fixtures' models
SPANS = [(0, 3), (3, 6), (6, 8), (2, 5), (0, 8)]


def _probe(report: DoctorReport) -> dict:
    """The probe check's details as the report's JSON carries them."""
    checks = json.loads(report.to_json())["checks"]
    return next(c for c in checks if c["name"] == "probe")["details"]


def _without_calibration(model: Path, dest: Path) -> Path:
    """A copy of `model` as a builder from before calibration leaves it: the
    golden file without its calibration tensors, the manifest naming that
    file's digest."""
    copy = Path(shutil.copytree(model, dest))
    arrays = {
        k: v
        for k, v in load_file(str(copy / GOLDEN_FILE)).items()
        if k.startswith(("boundary.", "logits"))
    }
    save_file(arrays, str(copy / GOLDEN_FILE), metadata={"format": "shardmesh-manifest/1"})
    manifest = json.loads((copy / MANIFEST_FILE).read_text())
    manifest["golden"]["sha256"] = hashlib.sha256((copy / GOLDEN_FILE).read_bytes()).hexdigest()
    (copy / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    return copy


def test_calibration_holds_every_span_of_every_recipe(model_dir: Path) -> None:
    golden = load_golden(model_dir, load_manifest(model_dir))
    assert sorted(golden.calibration) == sorted(RECIPES)
    spans = np.triu(np.ones((LAYERS + 1, LAYERS + 1), dtype=bool), k=1)
    for recipe, errors in golden.calibration.items():
        assert errors.shape == (LAYERS + 1, LAYERS + 1, PROBE_LENGTH)
        assert np.isfinite(errors[spans]).all() and (errors[spans] >= 0).all(), recipe
        assert np.isnan(errors[~spans]).all(), recipe  # no span [a, b) with a >= b
    # fp32 is the golden's own implementation: its reference error is nil;
    # the reduced recipes err measurably.
    assert np.nanmax(golden.calibration["fp32"]) < 1e-6
    assert all(np.nanmax(golden.calibration[r]) > 1e-4 for r in ("fp16", "bf16", "q8", "q4"))


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_doctor_measures_what_the_calibration_recorded(qwen3_dir: Path, recipe: str) -> None:
    """The calibration's layer-by-layer chains compute what one shard [a, b)
    computes, so the doctor on the reference implementation finds the
    recorded error, token for token, and admits within the stated rule."""
    golden = load_golden(qwen3_dir, load_manifest(qwen3_dir))
    for start, end in SPANS:
        report = run_doctor(qwen3_dir, start, end, recipe, "torch", measure=False)
        assert report.admitted, report.to_json()
        probe = _probe(report)
        reference = golden.calibration[recipe][start, end]
        assert probe["basis"] == "calibrated"
        assert probe["reference_error"] == pytest.approx(float(reference[probe["token"]]))
        assert probe["error"] == pytest.approx(probe["reference_error"], rel=1e-3, abs=1e-6)
        bound = calibrated_tolerance(RECIPES[recipe], reference.astype(np.float64))
        assert probe["tolerance"] == pytest.approx(float(bound[probe["token"]]))


def test_perturbed_layer_fails_the_calibrated_probe_in_every_recipe(tmp_path: Path) -> None:
    """Layer 1 of a tiny model with noise of its weights' own size and its
    digests regenerated: every recipe's calibrated doctor refuses it, and
    names the token and the rule."""
    model = make_tiny_model(tmp_path / "honest", layers=4)
    bad = Path(shutil.copytree(model, tmp_path / "perturbed"))
    tensors = load_file(str(bad / "model.safetensors"))
    manifest = json.loads((bad / MANIFEST_FILE).read_text())
    rng = np.random.default_rng(0)
    for name in [
        n for n in tensors if n.startswith("model.layers.1.") and n.endswith("proj.weight")
    ]:
        weight = tensors[name]
        tensors[name] = (weight + rng.standard_normal(weight.shape) * weight.std()).astype(
            np.float32
        )
        manifest["tensors"][name]["sha256"] = hashlib.sha256(tensors[name].tobytes()).hexdigest()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    (bad / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
    for recipe in RECIPES:
        report = run_doctor(bad, 0, 4, recipe, "torch", measure=False)
        assert (report.failed_check, report.reason) == ("probe", "outputs_mismatch"), recipe
        probe = _probe(report)
        assert probe["basis"] == "calibrated" and probe["error"] > probe["tolerance"]
        assert f"{CALIBRATION_MARGIN:g} x this span's reference error" in (report.message or "")


def test_a_manifest_without_calibration_keeps_its_identity_and_the_recipe_rule(
    qwen3_dir: Path, tmp_path: Path
) -> None:
    legacy = _without_calibration(qwen3_dir, tmp_path / "legacy")
    assert load_golden(legacy, load_manifest(legacy)).calibration == {}
    # One model, one identity, whichever builder wrote its manifest.
    assert manifest_digest(load_manifest(legacy)) == manifest_digest(load_manifest(qwen3_dir))
    for recipe in RECIPES:
        report = run_doctor(legacy, 0, LAYERS, recipe, "torch", measure=False)
        assert report.admitted, report.to_json()
        probe = _probe(report)
        assert probe["basis"] == "recipe" and probe["tolerance"] == RECIPES[recipe].tolerance
        assert "reference_error" not in probe and "token" not in probe
    # Rebuilding calibrates it again, under the same identity.
    rebuilt = build_manifest(legacy)
    assert manifest_digest(rebuilt) == manifest_digest(load_manifest(qwen3_dir))
    assert sorted(load_golden(legacy, rebuilt).calibration) == sorted(RECIPES)


@pytest.mark.parametrize("damage", ["shape", "nan"])
def test_a_malformed_calibration_is_refused(qwen3_dir: Path, tmp_path: Path, damage: str) -> None:
    model = Path(shutil.copytree(qwen3_dir, tmp_path / "copy"))
    arrays = load_file(str(model / GOLDEN_FILE))
    if damage == "shape":
        arrays["calibration.bf16"] = arrays["calibration.bf16"][:, :, :2].copy()
    else:
        arrays["calibration.bf16"][2, 5, 3] = np.nan
    save_file(arrays, str(model / GOLDEN_FILE))
    manifest = json.loads((model / MANIFEST_FILE).read_text())
    manifest["golden"]["sha256"] = hashlib.sha256((model / GOLDEN_FILE).read_bytes()).hexdigest()
    (model / MANIFEST_FILE).write_text(json.dumps(manifest))
    report = run_doctor(model, 0, 2, "fp32", "torch", measure=False)
    assert (report.failed_check, report.reason) == ("manifest", "golden_invalid")
    assert "calibration of bf16" in (report.message or "")


def test_manifest_build_reports_calibration_progress(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", layers=2, with_manifest=False)
    lines: list[str] = []
    with Progress("manifest build", emit=lines.append) as progress:
        build_manifest(model, progress=progress)
    calibrating = [line for line in lines if "calibrating" in line]
    assert calibrating == [
        f"manifest build: calibrating {r}: reference error of every span (2)" for r in RECIPES
    ]
