"""Run real `shardmesh node` processes on loopback, or in the sites of a WAN
lab: the demo's, the tests' and the benchmarks' harness.

Each node is a process started on port 0 (the OS picks; the node writes
what it got to `node.json` in its state dir), its output captured to a log
file. Nodes are forked from a fork server that has the heavy libraries
imported (`runtime.cli.forkserver`), or spawned where they must be.
`LocalSwarm`'s exit kills every child it started, whatever happened. It
holds each node's operator token and key (`LocalNode.admin_headers`,
`signed_headers`). A node given a lab `site` runs in that site's namespace
(`ip netns exec`, never forked) on its address; the host's namespace has no
route into a lab, so a `NamespaceBridge` forwards a loopback port here to
the node's API there, and `LocalNode.api` is that port (docs/lab.md).
"""

from __future__ import annotations

import ctypes
import math
import os
import select
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx
import trio

from mesh.identity import KEY_FILE, Identity
from runtime.cli import forkserver
from runtime.cli.policy_client import VOTERS_PATH
from runtime.cli.status_view import STATUS_PATH
from runtime.node.signed_http import sign_request
from runtime.node.state_dir import read_operator_token, read_ready

POLL_S = 0.1

STOP_TIMEOUT_S = 30.0
"""How long a stopped node may drain and leave before it is told again. An
idle node on a quiet machine exits within 2 s (a leave's grace, then
teardown); a machine that another job keeps busy has been seen to take
over 10 s, so the bound is generous: it only ever costs a stuck node."""

STOP_AT_ONCE_S = 10.0
"""After the second SIGTERM a node skips its drain; past this it is killed."""

SHARED_MACHINE_ENV = {"OMP_NUM_THREADS": "1"}
"""Every node of a local swarm shares this machine's cores: one compute
thread each keeps them from oversubscribing it (a tiny model gains nothing
from more, and a decode step runs one hop at a time anyway). `extra_env`
overrides it, e.g. for a benchmark of a model big enough to use threads."""

Views = dict[str, dict[str, Any] | None]
"""Each node's status document by node name (None: it did not answer)."""

CLONE_NEWNET = 0x40000000
"""setns(2)'s flag for a network namespace (Python 3.11's os has no setns)."""
NETNS_DIR = Path("/run/netns")
"""Where `ip netns` keeps a handle on each named namespace."""
BRIDGE_CHUNK = 65_536
BRIDGE_IDLE_S = 1.0
"""How often a bridged connection with no traffic checks the bridge is open."""


class Site(Protocol):
    """What a swarm needs of a `runtime.lab.netns.Lab` to run nodes in it."""

    def address(self, site: str) -> str: ...

    def namespace(self, site: str) -> str: ...

    def command(self, site: str, argv: Sequence[str]) -> list[str]: ...


class SwarmError(Exception):
    """A node failed to start, exited unexpectedly, or a wait timed out."""


class LocalNode:
    """One `shardmesh node` subprocess and what it reported when ready."""

    def __init__(
        self,
        name: str,
        state_dir: Path,
        log_path: Path,
        args: Sequence[str] = (),
        cpus: frozenset[int] | None = None,
        env: Mapping[str, str] | None = None,
        command: Sequence[str] = ("node",),
        forked: bool = True,
        site: str | None = None,
    ) -> None:
        self.name = name
        self.command = list(command)  # `node`, or `serve MODEL_DIR`: what the process runs
        self.args = list(args)  # this node's own flags (e.g. --model), kept across restarts
        self.cpus = cpus  # the cores it may run on (None: any), kept across restarts
        self.env = dict(env or {})  # this node's own environment additions, kept too
        self.state_dir = state_dir
        self.log_path = log_path
        self.forked = forked and site is None  # may come from the fork server (module doc)
        self.site = site  # the lab site whose namespace it runs in (None: this one)
        self.bridge: NamespaceBridge | None = None  # how this namespace reaches its API
        self.process: trio.Process | forkserver.ForkedProcess | None = None
        self.info: dict[str, Any] = {}
        self.escalated: str | None = None  # the signal its last stop had to add (`stop`)

    @property
    def node_id(self) -> str:
        return str(self.info["node_id"])

    @property
    def control(self) -> str:
        """The control address as `H:P` (what `--join` takes)."""
        return str(self.info["control"]).removeprefix("tcp://")

    @property
    def seed(self) -> str:
        """`NODE_ID@H:P`, what another node's `--join` takes to reach this one."""
        return f"{self.node_id}@{self.control}"

    @property
    def api(self) -> str:
        """Its API's base URL as this process reaches it (through the bridge
        for a node in a lab site; `own_api` is the node's own address)."""
        return self.bridge.url if self.bridge is not None else self.own_api

    @property
    def own_api(self) -> str:
        """The API address the node bound (in its site, for a lab node)."""
        return str(self.info["api"])

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    @property
    def operator_token(self) -> str:
        """The node's operator token (it writes it at its first start)."""
        return read_operator_token(self.state_dir)

    def admin_headers(self) -> dict[str, str]:
        """What an admin call to this node sends: its operator token."""
        return {"authorization": f"Bearer {self.operator_token}"}

    def signed_headers(self, path: str, body: bytes, method: str = "POST") -> dict[str, str]:
        """Headers that sign a request as this node, with its own key, as its
        placement driver signs its demand reports (`runtime.node.signed_http`)."""
        if not (self.state_dir / KEY_FILE).exists():
            raise SwarmError(f"{self.name} has no key yet: start it first")
        identity = Identity.load_or_create(self.state_dir)
        return {
            "content-type": "application/json",
            **sign_request(identity, method, path, body, time.time()),
        }

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def signal(self, signum: int) -> None:
        if self.running:
            assert self.process is not None
            self.process.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL: a crash, as far as the swarm can tell."""
        self.signal(signal.SIGKILL)

    async def wait_exit(self, timeout: float) -> int:
        """Wait for the process to end; SwarmError after `timeout` seconds."""
        assert self.process is not None
        with trio.move_on_after(timeout):
            return await self.process.wait()
        raise SwarmError(f"{self.name} did not exit within {timeout}s\n{self.log_tail()}")


class LocalSwarm:
    """Start, watch and stop nodes under one root directory."""

    def __init__(
        self,
        root: Path,
        *,
        profile: str = "local",
        python: str = sys.executable,
        extra_env: dict[str, str] | None = None,
        node_args: Sequence[str] = (),
        fork: bool = True,
        lab: Site | None = None,
    ) -> None:
        """`node_args` are added to every node's command line (e.g. flags
        like `--fault-injection` that a test needs on all of them); `fork`
        says whether nodes may come from the fork server (module doc);
        `lab` is where nodes given a `site` run."""
        self.root = root
        self.profile = profile
        self.python = python
        self.extra_env = extra_env or {}
        self.node_args = list(node_args)
        self.fork = fork
        self.lab = lab
        self.nodes: list[LocalNode] = []
        self._client: httpx.AsyncClient | None = None
        self._logs: list[Any] = []

    async def __aenter__(self) -> LocalSwarm:
        self.root.mkdir(parents=True, exist_ok=True)
        self._client = httpx.AsyncClient(timeout=2.0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        # Synchronous first: this must work even when the caller was cancelled.
        self.kill_all()
        for node in self.nodes:
            if node.process is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(5):
                    await node.process.wait()
        for handle in self._logs:
            handle.close()
        for node in self.nodes:
            if node.bridge is not None:
                node.bridge.close()
        if self._client is not None:
            with trio.CancelScope(shield=True):
                await self._client.aclose()

    def kill_all(self) -> None:
        for node in self.nodes:
            node.kill()

    # --- starting ------------------------------------------------------------

    def new_node(
        self,
        name: str | None = None,
        args: Sequence[str] = (),
        cpus: Iterable[int] | None = None,
        env: Mapping[str, str] | None = None,
        command: Sequence[str] = ("node",),
        forked: bool = True,
        site: str | None = None,
    ) -> LocalNode:
        """A node slot with its own state dir (not started yet); `args` are
        extra flags for this node only, `env` extra environment variables,
        `command` the subcommand that runs it (`serve MODEL_DIR` takes the
        same flags as `node`); `forked=False` always spawns a fresh
        interpreter (for a test of what a process imports); `site` runs it
        in that site of the swarm's lab (module doc).
        `cpus` pins its process (every thread: compute, ZeroMQ, the event
        loop) to those cores, so nodes sharing a machine stop sharing caches
        and cores (Linux only)."""
        if cpus is not None and not hasattr(os, "sched_setaffinity"):
            raise SwarmError("pinning nodes to cores needs Linux (os.sched_setaffinity)")
        if site is not None and self.lab is None:
            raise SwarmError(f"node in site {site!r}: the swarm was given no lab")
        name = name or f"node{len(self.nodes)}"
        pinned = None if cpus is None else frozenset(cpus)
        state, log = self.root / name, self.root / f"{name}.log"
        node = LocalNode(name, state, log, args, pinned, env, command, forked, site)
        self.nodes.append(node)
        return node

    @property
    def interpreter(self) -> list[str]:
        """How a spawned node's command line begins (a forked one skips it)."""
        return [self.python, "-m", "runtime.cli"]

    def command(self, node: LocalNode, joins: Sequence[str]) -> list[str]:
        host = "127.0.0.1" if node.site is None else self._lab.address(node.site)
        cmd = [
            *self.interpreter,
            *node.command,
            "--listen",
            f"{host}:0",
            "--api",
            f"{host}:0",
            "--state-dir",
            str(node.state_dir),
            "--profile",
            self.profile,
        ]
        for seed in joins:
            cmd += ["--join", seed]
        cmd += self.node_args + node.args
        return cmd if node.site is None else self._lab.command(node.site, cmd)

    @property
    def _lab(self) -> Site:
        if self.lab is None:
            raise SwarmError("this swarm was given no lab")
        return self.lab

    async def start(self, node: LocalNode, joins: Sequence[str] = ()) -> None:
        """Start (or restart) `node`'s process; does not wait for it."""
        if node.running:
            raise SwarmError(f"{node.name} is already running")
        node.info = {}
        env = dict(os.environ, PYTHONUNBUFFERED="1", **SHARED_MACHINE_ENV)
        env.update(self.extra_env)
        env.update(node.env)
        argv = self.command(node, joins)
        if node.site is not None and node.bridge is None:
            node.bridge = NamespaceBridge(self._lab.namespace(node.site), lambda: node.own_api)
        node.process = await self._fork(node, argv, env)
        if node.process is None:
            node.process = await self._spawn(node, argv, env)

    async def _fork(
        self, node: LocalNode, argv: list[str], env: dict[str, str]
    ) -> forkserver.ForkedProcess | None:
        """The node forked from this process's fork server, or None where it
        must be spawned: the swarm or node asked so, its flags set what a
        library reads at import (`--threads`), or the server failed."""
        if not (self.fork and node.forked) or "--threads" in argv:
            return None
        server = forkserver.server_for(self.python, env)  # one per import-time environment
        try:
            return await trio.to_thread.run_sync(
                server.spawn, argv[len(self.interpreter) :], env, node.log_path, node.cpus
            )
        except forkserver.ForkServerError as exc:
            print(f"{node.name}: spawning instead ({exc})", file=sys.stderr)
            return None

    async def _spawn(self, node: LocalNode, argv: list[str], env: dict[str, str]) -> trio.Process:
        handle = open(node.log_path, "ab")  # noqa: SIM115 - closed in __aexit__
        self._logs.append(handle)
        process = await trio.lowlevel.open_process(
            argv, stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT, env=env
        )
        if node.cpus is not None:
            # Right after the spawn, while the interpreter is still starting:
            # every thread it creates later (torch's, libzmq's) inherits this.
            os.sched_setaffinity(process.pid, node.cpus)
        return process

    async def wait_ready(self, node: LocalNode, timeout: float = 20.0) -> dict[str, Any]:
        """Wait until `node` wrote its ready file and its API answers."""
        assert node.process is not None
        with trio.move_on_after(timeout):
            while True:
                if not node.running:
                    raise SwarmError(
                        f"{node.name} exited with {node.process.returncode} before it was "
                        f"ready\n{node.log_tail()}"
                    )
                info = read_ready(node.state_dir, node.process.pid)
                if info is not None:
                    node.info = info
                    if await self.status(node) is not None:
                        return info
                await trio.sleep(POLL_S)
        raise SwarmError(f"{node.name} was not ready within {timeout}s\n{node.log_tail()}")

    async def start_ready(
        self, node: LocalNode, joins: Sequence[str] = (), timeout: float = 20.0
    ) -> dict[str, Any]:
        await self.start(node, joins)
        return await self.wait_ready(node, timeout)

    async def start_many(
        self, nodes: Sequence[LocalNode], joins: Sequence[str], timeout: float = 30.0
    ) -> None:
        """Start several nodes at once (process start-up dominates, so the
        processes boot in parallel) and wait until all are ready."""
        for node in nodes:
            await self.start(node, joins)
        deadline = trio.current_time() + timeout
        for node in nodes:
            await self.wait_ready(node, max(0.1, deadline - trio.current_time()))

    async def make_eligible(
        self, via: LocalNode, nodes: Iterable[LocalNode], timeout: float = 30.0
    ) -> None:
        """Commit, through `via` with its operator token, that each of
        `nodes` may become a Raft voter: one operator runs this whole
        swarm, so it trusts all of them. Asks again while there is no
        leader yet (503); SwarmError if a node is not eligible by `timeout`."""
        assert self._client is not None, "use LocalSwarm as an async context manager"
        headers = {**via.admin_headers(), "content-type": "application/json"}
        with trio.move_on_after(timeout):
            for node in nodes:
                while True:
                    try:
                        response = await self._client.post(
                            via.api + VOTERS_PATH, json={"node_id": node.node_id}, headers=headers
                        )
                    except httpx.HTTPError:
                        response = None
                    if response is not None and response.status_code == 200:
                        reason = response.json().get("reason")
                        if reason in (None, "already_eligible"):
                            break
                    await trio.sleep(POLL_S)
            return
        raise SwarmError(f"could not make the nodes eligible to vote within {timeout}s")

    # --- watching ------------------------------------------------------------

    async def status(self, node: LocalNode) -> dict[str, Any] | None:
        """The node's status document, or None when it does not answer."""
        if not node.info or self._client is None:
            return None
        try:
            response = await self._client.get(node.api + STATUS_PATH)
        except httpx.HTTPError:
            return None
        return response.json() if response.status_code == 200 else None

    async def views(self, nodes: Iterable[LocalNode]) -> dict[str, dict[str, Any] | None]:
        """Every listed node's status, fetched concurrently, by node name."""
        results: dict[str, dict[str, Any] | None] = {}

        async def one(node: LocalNode) -> None:
            results[node.name] = await self.status(node)

        async with trio.open_nursery() as nursery:
            for node in nodes:
                nursery.start_soon(one, node)
        return results

    async def wait_for(
        self,
        observers: Sequence[LocalNode],
        check: Callable[[Views], bool],
        timeout: float,
        what: str,
    ) -> float:
        """Poll the observers' status until `check(views)`; seconds it took.

        SwarmError after `timeout`, with each observer's last member states
        and drop counters, which is usually enough to see why."""
        start = trio.current_time()
        views: Views = {}
        with trio.move_on_after(timeout):
            while True:
                views = await self.views(observers)
                if check(views):
                    return trio.current_time() - start
                await trio.sleep(POLL_S)
        summary = {
            name: (member_states(view), (view or {}).get("drops")) for name, view in views.items()
        }
        raise SwarmError(f"{what}: not reached within {timeout}s; last views: {summary}")

    async def stop(self, node: LocalNode, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM (a drain and a graceful leave) and wait for the exit code.

        A node still running after `timeout` gets the second SIGTERM, its
        "stop at once", and after `STOP_AT_ONCE_S` more a SIGKILL: a stop
        always ends, and `node.escalated` says which signal it took. The
        code is the process's own (-9 after the SIGKILL)."""
        assert node.process is not None
        node.signal(signal.SIGTERM)
        for then in (signal.SIGTERM, signal.SIGKILL):
            with trio.move_on_after(timeout):
                return await node.process.wait()
            node.escalated = signal.Signals(then).name
            node.signal(then)
            timeout = STOP_AT_ONCE_S
        return await node.process.wait()


def member_states(status: dict[str, Any] | None) -> dict[str, str]:
    """node_id -> state in one node's view."""
    if status is None:
        return {}
    return {m["node_id"]: m["state"] for m in status.get("members", [])}


def all_see(
    observers: Sequence[LocalNode], subjects: Sequence[LocalNode], state: str
) -> Callable[[Views], bool]:
    """A check on views: every observer answers and sees every subject other
    than itself in `state`."""

    def check(views: Views) -> bool:
        for observer in observers:
            states = member_states(views.get(observer.name))
            if not states:
                return False
            for subject in subjects:
                if subject is not observer and states.get(subject.node_id) != state:
                    return False
        return True

    return check


def member_field(status: dict[str, Any] | None, node_id: str, name: str) -> Any:
    for member in (status or {}).get("members", []):
        if member["node_id"] == node_id:
            return member.get(name)
    return None


def state_matrix(nodes: Sequence[LocalNode], views: dict[str, dict[str, Any] | None]) -> str:
    """One row per observer, one column per subject: what each node thinks
    of each other node (A alive, S suspect, D dead, L left, . unknown or
    not started, ? observer not answering, - the observer itself); observers
    not started yet get no row, stopped ones say so."""
    letters = {"alive": "A", "suspect": "S", "dead": "D", "left": "L"}
    width = max(len(n.name) for n in nodes)
    header = " " * (width + 2) + " ".join(f"n{i}".rjust(3) for i in range(len(nodes)))
    lines = [header]
    for observer in nodes:
        if not observer.info:
            continue  # not started yet
        if not observer.running:
            lines.append(observer.name.ljust(width + 2) + "  (not running)")
            continue
        view = views.get(observer.name)
        states = member_states(view)
        cells = []
        for subject in nodes:
            if view is None:
                cells.append("?")
            elif subject is observer:
                cells.append("-")
            elif not subject.info:
                cells.append(".")
            else:
                cells.append(letters.get(states.get(subject.node_id, ""), "."))
        lines.append(observer.name.ljust(width + 2) + " ".join(c.rjust(3) for c in cells))
    return "\n".join(lines)


def dead_bound(profile: str, nodes: int) -> float:
    """The profile's documented worst case for "crash -> dead at every node"
    with `nodes` members (from `mesh.config`)."""
    from mesh.config import MembershipConfig

    config = MembershipConfig.profile(profile)
    bound = config.detection_bound(nodes)
    if not math.isfinite(bound) or bound <= 0:
        raise SwarmError(f"profile {profile} documents no finite detection bound")
    return float(bound)


class NamespaceBridge:
    """A loopback port in this process's namespace forwarded to an address in
    another network namespace: how the harness, in the host's namespace,
    reaches the API of a node in a lab site (the lab routes nothing from the
    host's namespace, by design). Each connection gets a thread that enters
    the target namespace (setns(2) moves only the calling thread) and
    copies bytes both ways until either side closes; the thread ends with it."""

    def __init__(self, namespace: str, target: Callable[[], str]) -> None:
        """`target()` is the URL (`http://H:P`) to reach there, asked at each
        connection: a node's API port is known only once it is ready."""
        self.namespace = namespace
        self.target = target
        self._open = True
        bridge = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                bridge._forward(self.request)

        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.1,), daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _forward(self, client: socket.socket) -> None:
        try:
            parts = urlsplit(self.target())
            enter_namespace(self.namespace)
            upstream = socket.create_connection((parts.hostname, parts.port), timeout=5.0)
        except (KeyError, OSError, ValueError):
            return  # not listening yet, or gone: the caller sees a closed connection
        with upstream:
            upstream.settimeout(None)
            self._copy(client, upstream)

    def _copy(self, a: socket.socket, b: socket.socket) -> None:
        while self._open:
            ready, _, _ = select.select([a, b], [], [], BRIDGE_IDLE_S)
            for source in ready:
                data = source.recv(BRIDGE_CHUNK)
                if not data:
                    return
                (b if source is a else a).sendall(data)

    def close(self) -> None:
        self._open = False
        self._server.shutdown()
        self._server.server_close()


def enter_namespace(name: str) -> None:
    """Move the calling thread into network namespace `name` (`ip netns`'s)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(NETNS_DIR / name, "rb") as handle:
        if libc.setns(handle.fileno(), CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {name}: {os.strerror(errno)}")
