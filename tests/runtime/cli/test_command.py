"""`runtime.cli.command`: the one-line runtime error every command shares."""

from __future__ import annotations

import pytest

from runtime.cli.command import PROG, fail


def test_fail_says_what_went_wrong_in_one_line_and_returns_the_code(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert fail("status", "cannot reach http://127.0.0.1:1") == 1
    assert fail("node", "--model: no such model folder", code=2) == 2
    assert capsys.readouterr() == (
        "",
        f"{PROG} status: error: cannot reach http://127.0.0.1:1\n"
        f"{PROG} node: error: --model: no such model folder\n",
    )
