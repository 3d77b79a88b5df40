"""The lab tests' fixture: `make_lab` (tests/runtime/lab/fixtures.py)."""

from tests.runtime.lab.fixtures import make_lab

__all__ = ["make_lab"]
