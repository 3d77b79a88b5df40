"""Where the admin commands find the operator token (`runtime.cli.operator_token`).

Real files in the test's tmp dir: a token file, a node's state dir written by
`runtime.node.state_dir`, the environment variable, and the default state
dir (pointed into tmp through `XDG_STATE_HOME`, which platformdirs reads).
Each source is checked for its precedence and its message when it is named
but holds no token.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.cli.operator_token import TOKEN_ENV, WHERE, OperatorToken, TokenError, find_token
from runtime.node.state_dir import (
    OPERATOR_TOKEN_FILE,
    default_state_dir,
    load_or_create_operator_token,
)


@pytest.fixture(autouse=True)
def default_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The default state dir, in tmp and empty (no node on this machine)."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    path = default_state_dir()
    assert path.is_relative_to(tmp_path)
    return path


def state_dir_with_token(path: Path) -> str:
    path.mkdir(parents=True)
    return load_or_create_operator_token(path)


def test_a_token_file_comes_first_and_is_stripped(tmp_path: Path, default_dir: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("  from-the-file\n")
    state_dir_with_token(tmp_path / "state")
    state_dir_with_token(default_dir)
    found = find_token(token_file, tmp_path / "state", environ={TOKEN_ENV: "from-env"})
    assert found == OperatorToken("from-the-file", f"--token-file {token_file}")
    assert found.headers() == {"authorization": "Bearer from-the-file"}


def test_a_state_dir_comes_before_the_environment(tmp_path: Path) -> None:
    token = state_dir_with_token(tmp_path / "state")
    found = find_token(state_dir=tmp_path / "state", environ={TOKEN_ENV: "from-env"})
    assert found.value == token and found.source == f"--state-dir {tmp_path / 'state'}"


def test_the_environment_comes_before_the_default_state_dir(default_dir: Path) -> None:
    state_dir_with_token(default_dir)
    assert find_token(environ={TOKEN_ENV: " from-env "}) == OperatorToken("from-env", TOKEN_ENV)
    # A blank variable is no token: the default state dir answers.
    found = find_token(environ={TOKEN_ENV: "  "})
    assert found.source == str(default_dir / OPERATOR_TOKEN_FILE)
    assert found.value == (default_dir / OPERATOR_TOKEN_FILE).read_text().strip()


def test_finding_none_is_no_error_and_the_refusal_says_where_a_token_comes_from() -> None:
    found = find_token(environ={})
    assert found == OperatorToken(None, "none")
    assert found.headers() == {}
    assert WHERE in found.refused() and "none was found" in found.refused()
    sent = OperatorToken("abc", "--token-file t")
    assert (
        sent.refused()
        == "the node refused the operator token from --token-file t (is it this node's?)"
    )


def test_a_named_source_without_a_token_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TokenError, match=r"--token-file .*missing"):
        find_token(tmp_path / "missing", environ={})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(TokenError, match="is empty"):
        find_token(empty, environ={TOKEN_ENV: "from-env"})
    (tmp_path / "state").mkdir()
    with pytest.raises(TokenError, match="--state-dir: no operator token at"):
        find_token(state_dir=tmp_path / "state", environ={TOKEN_ENV: "from-env"})
