"""What a node keeps on disk between runs, and the lock that guards it.

The state directory holds the identity key (`mesh.identity`), the last
incarnation and record seq, the operator token (`operator.token`, which every
call changing the swarm presents) and, while the node runs, `node.json`
saying where it listens. One process per state dir (an exclusive `flock`),
incarnations and record seqs only go up (stored before they are sent), and
`node.json` is written atomically once ready and removed at exit.

Why each rule: docs/design/node.md#the-state-directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any

import platformdirs

from mesh.files import replace_durably

log = logging.getLogger("shardmesh.node")

INCARNATION_FILE = "incarnation"
RECORD_SEQ_FILE = "record_seq"
READY_FILE = "node.json"
LOCK_FILE = "lock"
MAX_SANE_COUNTER = 2**48
"""The highest incarnation or record seq a state dir may hold. A node moves
them by refuting suspicions and republishing its record, a few times a
second at worst: 2**48 is thousands of years of that. A larger value is
damage or tampering, and starting from it would push the node toward the
wire's limit (2**63), where it could no longer outbid an accusation."""
OPERATOR_TOKEN_FILE = "operator.token"


class StateDirError(Exception):
    """The state dir is in use by another process or holds unreadable state."""


def default_state_dir() -> Path:
    """Where a node keeps its key when `--state-dir` is not given."""
    return platformdirs.user_state_path("shardmesh") / "node"


def _write_atomically(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write via a temporary file, fsync, rename, fsync the directory: after a
    crash the file holds either the old or the new content, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    replace_durably(tmp, path)


class StateDir:
    """An open, locked state directory. Close it (or use `with`) to unlock."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock_fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise StateDirError(
                f"state dir {path} is in use by another shardmesh node; "
                "give each node its own --state-dir"
            ) from None
        os.ftruncate(self._lock_fd, 0)
        os.write(self._lock_fd, f"{os.getpid()}\n".encode())
        self._stored: dict[str, int] = {}
        self.clear_ready()

    def close(self) -> None:
        self.clear_ready()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = -1

    def __enter__(self) -> StateDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- counters ------------------------------------------------------------

    def stored_counter(self, name: str) -> int | None:
        """The last stored value of counter `name`, or None if never stored."""
        path = self.path / name
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            return None
        if not text.isdigit():
            raise StateDirError(f"{path} is corrupt: {text[:40]!r} is not a counter")
        value = int(text)
        if value > MAX_SANE_COUNTER:
            raise StateDirError(
                f"{path} holds {value}, beyond anything a node reaches (at most "
                f"{MAX_SANE_COUNTER}): the file is damaged or was written by hand; remove it "
                "and the node starts that count over"
            )
        return value

    def store_counter(self, name: str, value: int) -> None:
        """Persist `value` for counter `name` if it is higher than what is
        stored (counters never go down)."""
        known = self._stored.get(name)
        if known is None:
            known = self.stored_counter(name)
        if known is not None and value <= known:
            self._stored[name] = known
            return
        _write_atomically(self.path / name, f"{value}\n".encode())
        self._stored[name] = value

    def next_incarnation(self) -> int:
        """The incarnation to start this run with (stored + 1, or 0 the first
        time), stored before it is returned."""
        stored = self.stored_counter(INCARNATION_FILE)
        incarnation = 0 if stored is None else stored + 1
        self.store_counter(INCARNATION_FILE, incarnation)
        return incarnation

    def operator_token(self) -> str:
        """This node's operator token, made on the first start; the log says
        where it is (the operator's admin commands read it there)."""
        token = load_or_create_operator_token(self.path)
        log.info(
            "operator token in %s (admin calls and `shardmesh policy --set` need it)",
            self.path / OPERATOR_TOKEN_FILE,
        )
        return token

    def store_incarnation(self, incarnation: int) -> None:
        self.store_counter(INCARNATION_FILE, incarnation)

    def record_seq(self) -> int:
        """The last node-record seq this node published (0 if none): the next
        run continues above it, or peers would drop its fresh record as a
        replay of an older one."""
        return self.stored_counter(RECORD_SEQ_FILE) or 0

    def store_record_seq(self, seq: int) -> None:
        self.store_counter(RECORD_SEQ_FILE, seq)

    # --- ready file ----------------------------------------------------------

    def write_ready(self, info: dict[str, Any]) -> None:
        """Say where the running node listens (read by the demo and tests,
        which start nodes on port 0 to avoid port races)."""
        body = dict(info, pid=os.getpid())
        _write_atomically(self.path / READY_FILE, json.dumps(body).encode(), 0o644)

    def clear_ready(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.path / READY_FILE).unlink()


def read_ready(path: Path, pid: int | None = None) -> dict[str, Any] | None:
    """The ready file of the node using state dir `path`, or None while it is
    not (yet) ready. With `pid`, a file left by another process counts as
    not ready."""
    try:
        info = json.loads((path / READY_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if pid is not None and info.get("pid") != pid:
        return None
    return info


def load_or_create_operator_token(path: Path) -> str:
    """The operator token in state dir `path`, created (mode 0600, never
    replaced) on first start. StateDirError if the file is readable by
    anyone but its owner, or holds no token."""
    token_path = path / OPERATOR_TOKEN_FILE
    try:
        fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = token_path.stat().st_mode & 0o777
        if mode & 0o077:
            raise StateDirError(
                f"{token_path} has mode {mode:o}; the operator token must be private (chmod 600)"
            ) from None
        if not token_path.read_bytes().strip():  # a crash right after creating it
            token = secrets.token_urlsafe(32)
            _write_atomically(token_path, (token + "\n").encode())
            return token
        return read_operator_token(path)
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    return token


def read_operator_token(path: Path) -> str:
    """The operator token of the node with state dir `path` (the admin
    CLI's `--state-dir`); StateDirError if there is none."""
    token_path = path / OPERATOR_TOKEN_FILE
    try:
        token = token_path.read_text().strip()
    except FileNotFoundError:
        raise StateDirError(
            f"no operator token at {token_path} (a node writes it at its first start)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise StateDirError(f"cannot read the operator token {token_path}: {exc}") from None
    if not token:
        raise StateDirError(f"{token_path} is empty")
    return token
