"""Numeric recipes (`runtime.model.recipes`): the table, which backend runs
which recipe where, and the two error measures the doctor judges by.
Calibrated admission on real manifests is in test_calibration.py."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.model.backends.base import BackendError
from runtime.model.recipes import (
    ALL_RECIPES,
    CALIBRATION_MARGIN,
    RECIPES,
    SUPPORT,
    calibrated_tolerance,
    check_recipe,
    get_recipe,
    relative_error,
    row_errors,
)


def test_five_recipes_coarser_ones_looser() -> None:
    assert list(RECIPES) == ["fp32", "fp16", "bf16", "q8", "q4"]
    assert frozenset(RECIPES) == ALL_RECIPES
    for name, recipe in RECIPES.items():
        assert recipe.name == name
        assert 0 < recipe.calibration_floor <= recipe.tolerance
    tolerance = {name: recipe.tolerance for name, recipe in RECIPES.items()}
    assert tolerance["fp32"] < tolerance["fp16"] < tolerance["bf16"] < tolerance["q4"]
    assert tolerance["fp16"] < tolerance["q8"] < tolerance["q4"]
    assert {r.bits for r in RECIPES.values()} == {None, 8, 4}
    assert RECIPES["q8"].dtype == RECIPES["q4"].dtype == "float32"  # float activations


def test_an_unknown_recipe_names_the_valid_ones() -> None:
    assert get_recipe("bf16") is RECIPES["bf16"]
    with pytest.raises(BackendError, match="unknown recipe 'int3'; choose one of fp32, fp16"):
        get_recipe("int3")


def test_check_recipe_by_backend_and_device_kind() -> None:
    assert check_recipe("torch", "q4", "cuda:1") is RECIPES["q4"]  # the kind before ":"
    assert check_recipe("mlx", "fp16", "gpu") is RECIPES["fp16"]
    with pytest.raises(BackendError, match="unknown backend 'onnx'; choose one of torch, mlx"):
        check_recipe("onnx", "fp32", "cpu")
    with pytest.raises(BackendError, match="backend mlx does not run on device 'cuda'"):
        check_recipe("mlx", "fp32", "cuda")
    with pytest.raises(BackendError, match="unknown recipe"):
        check_recipe("torch", "int3", "cpu")
    assert all(kinds for kinds in SUPPORT.values())


def test_a_recipe_missing_from_support_is_refused_with_what_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(SUPPORT, "torch", {"cpu": frozenset({"fp32", "bf16"})})
    with pytest.raises(BackendError, match="torch on cpu cannot run recipe q8; it runs fp32, bf16"):
        check_recipe("torch", "q8", "cpu")


def test_relative_error_is_the_worst_element_on_the_goldens_scale() -> None:
    golden = np.array([[1.0, -4.0], [2.0, 0.5]], dtype=np.float32)
    output = golden.copy()
    assert relative_error(output, golden) == 0.0
    output[1, 1] += 0.2
    assert relative_error(output, golden) == pytest.approx(0.2 / 4.0)
    assert relative_error(np.ones((1, 2)), np.zeros((1, 2))) > 1e20  # defined, not a division by 0
    with pytest.raises(BackendError, match="differs from golden"):
        relative_error(np.zeros((2, 3)), np.zeros((2, 2)))
    with pytest.raises(BackendError, match="differs from golden"):
        row_errors(np.zeros((3, 2)), np.zeros((2, 2)))


def test_the_calibrated_bound_is_the_margin_times_the_reference_plus_the_floor() -> None:
    reference = np.array([0.0, 0.01, 0.1])
    bound = calibrated_tolerance(RECIPES["bf16"], reference)
    np.testing.assert_allclose(bound, CALIBRATION_MARGIN * reference + 8e-3)


def test_row_errors_see_past_a_massive_activation() -> None:
    """Why the calibrated rule is per token: one huge value (an attention
    sink's channel) sets the scale of `relative_error` for the whole output,
    hiding a 5% error in another token; `row_errors` judges each token on
    its own scale."""
    golden = np.ones((4, 16), dtype=np.float32)
    golden[0, 3] = 26_000.0  # the sink token's massive channel
    output = golden.copy()
    output[2, 7] += 0.05
    assert relative_error(output, golden) < 2e-6
    np.testing.assert_allclose(row_errors(output, golden), [0.0, 0.0, 0.05, 0.0], atol=1e-7)
