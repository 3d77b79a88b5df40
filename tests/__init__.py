"""The test suite, laid out like the source: tests/<package>/test_<module>.py.

`tests/processes/` holds the tests that start real multi-process swarms; the
shared helpers (fixtures, fault hooks, a fake hub) sit here at the top.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
"""The repository's root, for tests that read its files."""
