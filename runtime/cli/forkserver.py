"""A fork server for local node processes: the heavy imports done once.

A node process spends most of its start-up importing torch, transformers
(which pulls in torch._dynamo), MLX and our own modules: about 7 of its 8
CPU-seconds on this 2-core machine. `LocalSwarm` starts many nodes (the
suite starts hundreds), so it asks one `ForkServer` - a fresh interpreter
that imported `PRELOAD` before anything else ran - to fork each node. The
child then runs `python -m runtime.cli ARGS` as a spawned one would: its own
argv, environment, working directory, log file, exit code and signals.
What is read once at import time (libgomp's and OpenBLAS's settings, the
hash seed) is the server's, so nodes share a server only where their
environments agree there (`IMPORT_TIME_ENV`). docs/design/cli.md says more.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, NoReturn

import trio

PRELOAD = (
    "runtime.model.backends.torch_backend",
    "mlx.core",
    "mlx_lm",
    "runtime.model.backends.mlx_backend",
    "runtime.node.daemon",
    "runtime.cli.main",
)
"""What the server imports before it forks anything: both backends'
libraries and the node's own modules (none of ours reads the environment
at import time; each reads it when it runs)."""

IMPORT_TIME_ENV = (
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "PYTHON",
    "MLX_",
    "TORCH",
    "PYTORCH_",
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "SHARDMESH_TEST_",
)
"""Prefixes of the variables read once, when a library loads (libgomp its
threads, huggingface_hub its endpoint and offline mode...) or when the
interpreter starts (the tests' fault hooks: a sitecustomize that reads
SHARDMESH_TEST_FAULT): a child inherits the server's values, so a node that
asks for others gets a server of its own."""

READY_TIMEOUT_S = 120.0
"""How long the server may take to import `PRELOAD` (a few seconds; far
more on a machine that another job keeps busy) before nodes are spawned
without it."""


def import_time_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of `env` that a forked child would inherit, not read."""
    return {name: value for name, value in env.items() if name.startswith(IMPORT_TIME_ENV)}


class ForkServerError(Exception):
    """The server could not start or fork; the caller spawns instead."""


class ForkedProcess:
    """A node the server forked: what `LocalSwarm` uses of `trio.Process`.
    The server is its parent, so the exit code comes from the server."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server = server
        self.pid = pid

    @property
    def returncode(self) -> int | None:
        """As `subprocess.Popen`'s: None while it runs, -N after signal N."""
        return self.server.exit_code(self.pid)

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # exited: reported soon
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    async def wait(self) -> int:
        while (code := self.returncode) is None:
            await trio.sleep(0.02)
        return code


class ForkServer:
    """One server process and the thread that reads what it reports."""

    def __init__(self, python: str, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self._process = subprocess.Popen(
            [python, "-m", "runtime.cli.forkserver"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.env,
        )
        self._lock = threading.Lock()  # one request in flight at a time
        self._replies: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        self._exits: dict[int, int] = {}
        self._reader = threading.Thread(target=self._read, name="forkserver", daemon=True)
        self._reader.start()

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        log: Path,
        cpus: frozenset[int] | None = None,
        module: str = "runtime.cli",
    ) -> ForkedProcess:
        """Fork `python -m MODULE *argv` with `env`, in this working
        directory, its output appended to `log`, pinned to `cpus` (None:
        any). Blocks until forked (the first call waits for the imports)."""
        request = {
            "module": module,
            "argv": list(argv),
            "env": dict(env),
            "cwd": os.getcwd(),
            "log": str(log),
            "cpus": None if cpus is None else sorted(cpus),
        }
        with self._lock:
            self._await_reply("ready", keep=True)
            stdin = self._process.stdin
            assert stdin is not None
            try:
                stdin.write(json.dumps(request).encode() + b"\n")
                stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                raise ForkServerError(f"the fork server is gone: {exc}") from exc
            reply = self._await_reply("pid")
        return ForkedProcess(self, int(reply["pid"]))

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            return self._exits.get(pid)

    def close(self) -> None:
        """Stop the server (its children are the swarms' to stop)."""
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()

    def _await_reply(self, key: str, *, keep: bool = False) -> dict[str, Any]:
        with self._changed:
            ok = self._changed.wait_for(
                lambda: (
                    any(key in r or "error" in r for r in self._replies)
                    or self._process.poll() is not None
                ),
                timeout=READY_TIMEOUT_S,
            )
            reply = next((r for r in self._replies if key in r or "error" in r), None)
            if not ok or reply is None:
                raise ForkServerError(f"the fork server gave no {key!r} (it may have died)")
            if "error" in reply or not keep:
                self._replies.remove(reply)
            if "error" in reply:
                raise ForkServerError(reply["error"])
            return reply

    def _read(self) -> None:
        stdout = self._process.stdout
        assert stdout is not None
        for line in stdout:
            message = json.loads(line)
            with self._changed:
                if "exit" in message:
                    self._exits[int(message["exit"])] = int(message["code"])
                else:
                    self._replies.append(message)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()


_servers: dict[tuple[str, str], ForkServer] = {}
_servers_lock = threading.Lock()


def server_key(python: str, env: Mapping[str, str]) -> tuple[str, str]:
    """Which server a node with `env` forks from: nodes share one only where
    everything read at import time is the same."""
    return python, json.dumps(import_time_env(env), sort_keys=True)


def server_for(python: str, env: Mapping[str, str]) -> ForkServer:
    """This process's server for `python` and `env`'s import-time part,
    started on first use and stopped when this process exits."""
    key = server_key(python, env)
    with _servers_lock:
        if not _servers:
            atexit.register(close_all)
        server = _servers.get(key)
        if server is None or server._process.poll() is not None:
            server = _servers[key] = ForkServer(python, env)
    return server


def close_all() -> None:
    with _servers_lock:
        for server in _servers.values():
            server.close()
        _servers.clear()


# --- the server process -------------------------------------------------------


def serve(requests: int, replies: IO[bytes]) -> None:
    """Import PRELOAD, then fork a child per request line on fd `requests`
    until EOF, and report each child's exit. SIGCHLD wakes the loop through
    a pipe (`signal.set_wakeup_fd`), so nothing polls."""
    import importlib
    import select

    from runtime.cli.node_process import COMPUTE_ENV_DEFAULTS

    for name, value in COMPUTE_ENV_DEFAULTS.items():  # as a node sets them, before torch
        os.environ.setdefault(name, value)
    for module in PRELOAD:
        importlib.import_module(module)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write)
    inherited = (requests, replies.fileno(), wake_read, wake_write)
    _reply(replies, {"ready": True})
    pending = b""
    while True:
        readable, _, _ = select.select([requests, wake_read], [], [])
        if wake_read in readable:
            os.read(wake_read, 4096)
        _reap(replies)
        if requests in readable:
            chunk = os.read(requests, 1 << 16)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                _fork(json.loads(line), replies, inherited)


def _fork(request: dict[str, Any], replies: IO[bytes], inherited: Sequence[int]) -> None:
    try:
        pid = os.fork()
    except OSError as exc:
        _reply(replies, {"error": f"fork failed: {exc}"})
        return
    if pid == 0:
        _run_child(request, closing=inherited)
    _reply(replies, {"pid": pid})


def _reply(replies: IO[bytes], message: dict[str, Any]) -> None:
    replies.write(json.dumps(message).encode() + b"\n")
    replies.flush()


def _reap(replies: IO[bytes]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _reply(replies, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _run_child(request: dict[str, Any], closing: Sequence[int]) -> NoReturn:
    """In the forked child: become `python -m MODULE ARGV`, then exit the
    way an interpreter does (threads joined, atexit run)."""
    import runpy
    import traceback

    code: object = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if request.get("cpus") is not None:  # before the node starts a thread
            os.sched_setaffinity(0, request["cpus"])
        _redirect(Path(request["log"]))
        for fd in closing:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [request["module"], *request["argv"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    except BaseException:
        traceback.print_exc()
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what interpreter exit does first
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(_exit_status(code))


def _exit_status(code: object) -> int:
    """`sys.exit(code)`'s status: None is 0, an int itself, anything else
    (a message, already printed by the caller's print) 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _redirect(log: Path) -> None:
    """stdin from /dev/null, stdout and stderr appended to `log`, as
    `LocalSwarm` spawns them, and Python's own streams rebuilt on them."""
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stream
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def main() -> NoReturn:
    """`python -m runtime.cli.forkserver`: requests on stdin, replies on
    stdout (Python's own stdout goes to stderr, so a stray print from an
    import cannot corrupt a reply)."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    serve(0, replies)
    os._exit(0)


if __name__ == "__main__":
    main()
