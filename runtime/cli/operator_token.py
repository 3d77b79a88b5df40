"""Where the admin commands find the node's operator token.

A node writes its token to `STATE_DIR/operator.token` at its first start
(`runtime.node.state_dir`); calls that change the swarm send it as
`Authorization: Bearer TOKEN`. The first of these that is given wins:

1. `--token-file PATH`: a file holding the token;
2. `--state-dir DIR`: the node's state dir (its `operator.token`);
3. `SHARDMESH_TOKEN`: the token itself;
4. the default state dir of a node on this machine, if it holds one.

Finding none is not an error by itself (the command asks anyway and, when
the node says 401, says where a token can come from).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from runtime.node.state_dir import (
    OPERATOR_TOKEN_FILE,
    StateDirError,
    default_state_dir,
    read_operator_token,
)

TOKEN_ENV: Final = "SHARDMESH_TOKEN"
WHERE: Final = f"set {TOKEN_ENV}, or pass --token-file PATH or --state-dir DIR (the node's)"


class TokenError(Exception):
    """A token source that was named explicitly cannot be read."""


@dataclass(frozen=True)
class OperatorToken:
    """A token (None: none found) and where it came from, for messages."""

    value: str | None
    source: str

    def headers(self) -> dict[str, str]:
        return {} if self.value is None else {"authorization": f"Bearer {self.value}"}

    def refused(self) -> str:
        """One line for a 401: what was sent, and where a token comes from."""
        if self.value is None:
            return f"this call needs the node's operator token and none was found: {WHERE}"
        return f"the node refused the operator token from {self.source} (is it this node's?)"


def find_token(
    token_file: Path | None = None,
    state_dir: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> OperatorToken:
    """The operator token from the first source given (see the module doc);
    TokenError if `token_file` or `state_dir` was given and holds none."""
    env = os.environ if environ is None else environ
    if token_file is not None:
        try:
            value = token_file.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenError(f"--token-file {token_file}: {exc}") from None
        if not value:
            raise TokenError(f"--token-file {token_file} is empty")
        return OperatorToken(value, f"--token-file {token_file}")
    if state_dir is not None:
        try:
            return OperatorToken(read_operator_token(state_dir), f"--state-dir {state_dir}")
        except StateDirError as exc:
            raise TokenError(f"--state-dir: {exc}") from None
    if env.get(TOKEN_ENV, "").strip():
        return OperatorToken(env[TOKEN_ENV].strip(), TOKEN_ENV)
    default = default_state_dir()
    try:
        return OperatorToken(read_operator_token(default), str(default / OPERATOR_TOKEN_FILE))
    except StateDirError:
        return OperatorToken(None, "none")
