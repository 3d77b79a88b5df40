"""A `Topology` built as Linux network namespaces, and torn down again.

`Lab` makes a core namespace, one per site, and one per NAT router, joined
by veth pairs (`ip -batch`); a TUN device in the core and policy routing
send every packet between sites through the delayer (`runtime.lab.delayer`,
delay, jitter and loss), and TBF qdiscs on each access link's egress cap
its rate in the kernel. A home router masquerades on its WAN side with
nftables (port-preserving, or fully random: symmetric) and drops what
nobody inside asked for. `spawn` runs a program in a site (`ip netns exec`),
`rtt` and `throughput` measure with `runtime.lab.probe`, and `close` (also
on an exception in the `with`) kills what it spawned and removes every
namespace it made. `unavailable()` says why no lab can be made here (not
root, no `ip`, `tc` or `nft`, no /dev/net/tun), or None.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import secrets
import select
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Final

from runtime.lab import commands
from runtime.lab.topology import TUN_IF, Plan, Topology, make_plan

COMMAND_TIMEOUT_S: Final = 20.0
"""One `ip`/`tc`/`nft` call; a whole lab's batch takes well under a second."""
READY_TIMEOUT_S: Final = 10.0
"""A Python instrument or the delayer starting in a namespace (about 0.1 s idle)."""
STOP_GRACE_S: Final = 1.0
"""SIGTERM's grace before SIGKILL, for what the lab spawned."""
ECHO_PORT: Final = 47_007
"""Where `rtt`'s echo listens in a site; `throughput`'s sink is one above."""
GENERATED_PREFIX: Final = re.compile(r"lab[0-9a-f]{4}\Z")
ROOT: Final = Path(__file__).resolve().parents[2]


class LabError(RuntimeError):
    """A lab could not be built, measured or removed; says which step."""


def _which(tool: str) -> str | None:
    """Where `tool` is: on PATH, or in the sbin folders a user's PATH may lack."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin:/usr/bin"
    return shutil.which(tool, path=path)


def _tool(name: str) -> str:
    return _which(name) or name


def _run(argv: Sequence[str], stdin: str | None = None, check: bool = True) -> str:
    """Run one command to its end (bounded); its stdout, or LabError with
    the command and its stderr."""
    try:
        done = subprocess.run(
            [_tool(argv[0]), *argv[1:]],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LabError(f"{' '.join(argv)}: {exc}") from None
    if check and done.returncode != 0:
        raise LabError(f"{' '.join(argv)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done.stdout


@functools.cache
def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (the lab tests run as root in CI)"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nft", "nftables")):
        if _which(tool) is None:
            return f"`{tool}` is not installed (package {package}; `make lab-deps` installs it)"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing: the delayer needs a TUN device"
    trial = f"labchk{os.getpid() % 100_000}"
    try:
        _run(["ip", "netns", "add", trial])
        _run(["ip", "netns", "exec", trial, _tool("nft"), "list", "ruleset"])
    except LabError as exc:
        return f"cannot make a network namespace with nftables here: {exc}"
    finally:
        _run(["ip", "netns", "del", trial], check=False)
    return None


def namespaces() -> list[str]:
    """Every named network namespace on this machine."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line]


def remove_namespaces(names: Sequence[str]) -> list[str]:
    """Kill every process in these namespaces and delete them; those that
    were there."""
    present = [name for name in names if name in set(namespaces())]
    for name in present:
        for pid in _run(["ip", "netns", "pids", name], check=False).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    if present:
        _run(["ip", "-force", "-batch", "-"], "".join(f"netns del {n}\n" for n in present), False)
    return present


def leftovers(prefix: str | None = None) -> list[str]:
    """The namespaces of lab `prefix`, or of every lab that named itself."""
    found = []
    for name in namespaces():
        head = name.split("-", 1)[0]
        if (head == prefix if prefix else GENERATED_PREFIX.match(head)) and "-" in name:
            found.append(name)
    return found


@dataclass(frozen=True)
class RttSample:
    """Round trips measured between two sites, in milliseconds."""

    sent: int
    rtt_ms: tuple[float, ...]

    @property
    def loss(self) -> float:
        return 1.0 - len(self.rtt_ms) / self.sent if self.sent else 0.0

    @property
    def median(self) -> float:
        return statistics.median(self.rtt_ms) if self.rtt_ms else float("nan")

    def summary(self) -> dict[str, Any]:
        rtts = sorted(self.rtt_ms)
        if not rtts:
            return {"sent": self.sent, "received": 0, "loss": 1.0}
        return {
            "sent": self.sent,
            "received": len(rtts),
            "loss": round(self.loss, 4),
            "min_ms": rtts[0],
            "median_ms": round(self.median, 3),
            "mean_ms": round(statistics.fmean(rtts), 3),
            "p95_ms": rtts[min(len(rtts) - 1, int(0.95 * len(rtts)))],
            "max_ms": rtts[-1],
        }


class Lines:
    """JSON lines from a child's stdout, each waited for with a deadline."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._fd = stream.fileno()
        self._pending = b""

    def next(self, timeout_s: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._fd], [], [], left)[0]:
                raise LabError(f"{what}: no answer within {timeout_s:.0f} s")
            chunk = os.read(self._fd, 65_536)
            if not chunk:
                raise LabError(f"{what}: exited without an answer")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        try:
            document = json.loads(line)
        except ValueError:
            raise LabError(f"{what}: said {line[:200]!r}, not JSON") from None
        if not isinstance(document, dict):
            raise LabError(f"{what}: said {line[:200]!r}, not a JSON object")
        return document


def _stop(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM to its process group, SIGKILL after the grace; reaped."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            proc.send_signal(sig)
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            continue
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def fresh_prefix() -> str:
    """A prefix no namespace here uses: `lab` and four hex digits."""
    taken = {name.split("-", 1)[0] for name in namespaces()}
    for _ in range(100):
        prefix = f"lab{secrets.token_hex(2)}"
        if prefix not in taken:
            return prefix
    raise LabError("no free lab prefix after 100 tries: remove old labs (`shardmesh lab down`)")


class Lab:
    """One topology built as namespaces, for the length of a `with`."""

    def __init__(self, topology: Topology, prefix: str | None = None) -> None:
        self.topology = topology
        self._prefix = prefix
        self._plan: Plan | None = None
        self._made: list[str] = []
        self._spawned: list[subprocess.Popen[Any]] = []
        self._delayer: subprocess.Popen[bytes] | None = None
        self._delayer_lines: Lines | None = None
        self.priority = "not started"
        """The scheduling the delayer got (`SCHED_FIFO 20`, or what it fell back to)."""

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            raise LabError("the lab is not built: use `with Lab(topology) as lab:`")
        return self._plan

    def __enter__(self) -> Lab:
        if self._plan is not None:  # refused before the try: the lab built stays up
            raise LabError(f"lab {self._plan.prefix} is built already: build a new Lab instead")
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    def build(self) -> None:
        """Make every namespace, link, route, NAT rule and qdisc, then start
        the delayer; LabError says which step failed."""
        reason = unavailable()
        if reason is not None:
            raise LabError(reason)
        plan = self._plan = make_plan(self.topology, self._prefix or fresh_prefix())
        before = set(namespaces())
        taken = sorted(before & set(plan.namespaces))
        if taken:
            raise LabError(f"the namespaces {taken} exist already: another lab uses {plan.prefix}")
        try:
            _run(["ip", "-batch", "-"], "".join(f"netns add {ns}\n" for ns in plan.namespaces))
        finally:  # what this lab made, and so may remove: never another's
            self._made = [ns for ns in namespaces() if ns in plan.namespaces and ns not in before]
        for ns in plan.namespaces:
            forwards = ns == plan.core_ns or any(s.router_ns == ns for s in plan.sites)
            _run(["ip", "netns", "exec", ns, "sh", "-c", commands.sysctl_script(forwards)])
        self._ip(plan.core_ns, commands.core_batch(plan))
        for site, shape in zip(plan.sites, self.topology.sites, strict=True):
            if site.router_ns is not None:
                self._ip(site.router_ns, commands.router_batch(site))
                nft = ["ip", "netns", "exec", site.router_ns, _tool("nft"), "-f", "-"]
                _run(nft, commands.nat_ruleset(shape.nat))
            self._ip(site.host_ns, commands.host_batch(site))
        for ns, lines in commands.tc_batches(plan).items():
            _run(["tc", "-n", ns, "-batch", "-"], "\n".join(lines) + "\n")
        self._start_delayer()

    def _ip(self, ns: str, lines: list[str]) -> None:
        _run(["ip", "-n", ns, "-batch", "-"], "\n".join(lines) + "\n")

    def _start_delayer(self) -> None:
        plan = self.plan
        argv = [sys.executable, "-m", "runtime.lab.delayer", "--tun", TUN_IF]
        proc = self._delayer = subprocess.Popen(
            [_tool("ip"), "netns", "exec", plan.core_ns, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=_python_env(),
        )
        assert proc.stdin is not None and proc.stdout is not None
        spec = {"prefix": plan.prefix, "topology": self.topology.to_spec()}
        proc.stdin.write(json.dumps(spec).encode() + b"\n")
        proc.stdin.flush()
        self._delayer_lines = Lines(proc.stdout)
        try:
            ready = self._delayer_lines.next(READY_TIMEOUT_S, "the delayer")
        except LabError as exc:
            raise LabError(f"{exc}: {_stderr_of(proc)}") from None
        self.priority = str(ready.get("priority"))

    def delayer_stats(self) -> dict[str, Any]:
        """The delayer's counters: packets forwarded, lost, unroutable, its
        lateness (release to write) quantiles, and per path sent and lost."""
        if self._delayer is None or self._delayer_lines is None or self._delayer.stdin is None:
            raise LabError("the delayer is not running")
        self._delayer.stdin.write(b"stats\n")
        self._delayer.stdin.flush()
        return self._delayer_lines.next(READY_TIMEOUT_S, "the delayer's stats")

    def delayer_running(self) -> bool:
        return self._delayer is not None and self._delayer.poll() is None

    # --- running things in the sites -------------------------------------------

    def namespace(self, site: str) -> str:
        """The namespace `site`'s processes run in."""
        return self.plan.site(site).host_ns

    def address(self, site: str) -> str:
        """`site`'s own address: public, or private behind its router."""
        return self.plan.site(site).address

    def public_address(self, site: str) -> str:
        """Where `site` is seen from the internet: its own address, or its router's."""
        return self.plan.site(site).wan_address

    def command(self, site: str, argv: Sequence[str]) -> list[str]:
        """`argv` as it runs in `site`: `ip netns exec NS argv...`."""
        return [_tool("ip"), "netns", "exec", self.namespace(site), *argv]

    def spawn(self, site: str, argv: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
        """Start `argv` in `site` (its own process group; `close` stops it)."""
        popen.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(site, argv), **popen)
        self._spawned.append(proc)
        return proc

    # --- measuring ---------------------------------------------------------------

    def _probe(self, site: str, args: Sequence[str]) -> tuple[subprocess.Popen[bytes], Lines]:
        argv = [sys.executable, "-m", "runtime.lab.probe", *args]
        proc = self.spawn(site, argv, stdout=subprocess.PIPE, env=_python_env())
        assert proc.stdout is not None
        return proc, Lines(proc.stdout)

    def echo(
        self, site: str, port: int = ECHO_PORT, punch: Sequence[str] = (), lifetime_s: float = 60
    ) -> subprocess.Popen[bytes]:
        """A UDP echo in `site`, listening once this returns; with `punch`,
        it first sends to each HOST:PORT (opening its NAT to answers)."""
        args = ["echo", "--port", str(port), "--lifetime", str(lifetime_s)]
        for target in punch:
            args += ["--punch", target]
        proc, lines = self._probe(site, args)
        lines.next(READY_TIMEOUT_S, f"the echo in {site}")
        return proc

    def ping(
        self,
        site: str,
        targets: Sequence[str],
        count: int = 20,
        interval_s: float = 0.02,
        wait_s: float = 0.5,
        port: int = 0,
    ) -> dict[str, Any]:
        """`runtime.lab.probe`'s ping from `site` (one socket, on `port`) to
        each HOST:PORT: per target its sent count, RTTs and the address its
        echo saw."""
        args = ["ping", "--count", str(count), "--interval", str(interval_s)]
        args += ["--wait", str(wait_s), "--port", str(port)]
        for target in targets:
            args += ["--to", target]
        proc, lines = self._probe(site, args)
        limit = READY_TIMEOUT_S + count * interval_s + wait_s
        try:
            return lines.next(limit, f"the ping from {site}")
        finally:
            _stop(proc)

    def rtt(self, a: str, b: str, count: int = 20, interval_s: float = 0.02) -> RttSample:
        """Round trips between sites `a` and `b` (the echo runs on the one
        that can be reached: a public site)."""
        client, server = self._reachable_pair(a, b)
        target = f"{self.address(server)}:{ECHO_PORT}"
        echo = self.echo(server)
        try:
            result = self.ping(client, [target], count, interval_s)["targets"][target]
        finally:
            _stop(echo)
        return RttSample(result["sent"], tuple(result["rtt_ms"]))

    def _reachable_pair(self, a: str, b: str) -> tuple[str, str]:
        """(client, server): the server is public, so the client can reach it."""
        if a == b:
            raise LabError(f"rtt from {a} to itself: name two sites")
        if not self.topology.site(b).behind_nat:
            return a, b
        if not self.topology.site(a).behind_nat:
            return b, a
        raise LabError(f"{a} and {b} are both behind NAT: neither can reach the other")

    def throughput(self, src: str, dst: str, rate: int, duration_s: float = 1.0) -> dict[str, Any]:
        """UDP from `src` to `dst` offered at `rate` bytes/s for `duration_s`:
        what arrived, and at what rate (bytes/s)."""
        if self.topology.site(dst).behind_nat:
            raise LabError(f"{dst} is behind NAT: measure towards a public site")
        port = ECHO_PORT + 1
        sink, lines = self._probe(dst, ["sink", "--port", str(port), "--idle", "0.5"])
        try:
            lines.next(READY_TIMEOUT_S, f"the sink in {dst}")
            target = f"{self.address(dst)}:{port}"
            blast = ["blast", "--to", target, "--rate", str(rate), "--duration", str(duration_s)]
            sender, sent = self._probe(src, blast)
            offered = sent.next(READY_TIMEOUT_S + duration_s, f"the blast from {src}")
            _stop(sender)
            return {**lines.next(READY_TIMEOUT_S, f"the sink in {dst}"), "offered": offered}
        finally:
            _stop(sink)

    def close(self) -> None:
        """Stop what the lab spawned, then the delayer, then remove every
        namespace it made (their links go with them). Safe to call twice;
        LabError if a namespace could not be removed."""
        for proc in reversed(self._spawned):
            _stop(proc)
        self._spawned.clear()
        if self._delayer is not None:
            _stop(self._delayer)  # stdin closed too: the delayer ends at end of file
            self._delayer = None
        if not self._made:
            return
        remove_namespaces(self._made)
        stuck = sorted(set(self._made) & set(namespaces()))
        self._made = stuck
        if stuck:
            raise LabError(f"could not remove the namespaces {stuck}")


def _python_env() -> dict[str, str]:
    """The environment for our own Python programs in a namespace: this
    checkout importable even where the package is not installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _stderr_of(proc: subprocess.Popen[bytes]) -> str:
    """What a child that failed to start said, once it is gone."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(STOP_GRACE_S)
    said = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
    return said[-2000:] or "(nothing on stderr)"
