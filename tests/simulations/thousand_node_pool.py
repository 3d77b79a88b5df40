"""The 1,000-node runs, started when the suite starts and read when their tests run.

The runs (tests/simulations/thousand_node_runs.py) take minutes of CPU. Started
by their tests, they kept an xdist worker waiting minutes for them; started
right after collection, in a process group of their own at low priority, they
soak up the CPU the rest of the suite leaves idle for its whole length (a swarm
test mostly waits on timers), and their tests, scheduled last, read results
that are mostly in by then. Each run is deterministic, so when it runs changes
nothing. One process per test session starts them: the first to claim the
session's directory (`os.mkdir` is atomic), so every xdist worker may ask. The
runner exits when its runs are done, or when the pytest process that owns the
session is gone (an aborted suite leaves nothing running).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, TypeVar

import pytest

from simulations import compiled
from tests.simulations.thousand_node_runs import lossy_run, partition_run

FALSE_POSITIVE_SEEDS = range(2000, 2020)
PARTITION_SEED = 31
RUNS: dict[str, tuple[Callable[[int], Any], tuple[int, ...]]] = {
    # Longest first: the partition run is the longest single run.
    "partition": (partition_run, (PARTITION_SEED,)),
    "lossy": (lossy_run, tuple(FALSE_POSITIVE_SEEDS)),
}
"""What a test can ask for (`needs`): a run function and the seeds it runs."""

NICENESS = 10
"""How far below the rest of the suite the runs are scheduled: enough that a
swarm test's node processes (whose timeouts assume one busy core beside
them, not three) take the CPU whenever they want it."""

WATCH_INTERVAL_S = 1.0
"""How often the runner checks that the session's pytest process lives."""

POLL_INTERVAL_S = 0.5
"""How often a test looks for its results."""

CORE_FILE = "core.pickle"
LOG_FILE = "runner.log"
PID_FILE = "runner.pid"

F = TypeVar("F", bound=Callable[..., Any])


def needs(run: str) -> Callable[[F], F]:
    """Marks a test as reading `run`'s results (what collection starts)."""
    assert run in RUNS, run

    def mark(test: F) -> F:
        test.thousand_node_run = run  # type: ignore[attr-defined]
        return test

    return mark


def runs_of(tests: Iterable[object]) -> list[str]:
    """The runs the collected `tests` (pytest items) need, in RUNS order."""
    wanted = {getattr(getattr(t, "function", None), "thousand_node_run", None) for t in tests}
    return [run for run in RUNS if run in wanted]


def session_dir(config: pytest.Config) -> Path:
    """Where this test session's runner writes: one per session, whichever
    xdist worker asks (they share the controller's test run id)."""
    workerinput = getattr(config, "workerinput", None)
    key = workerinput["testrunuid"] if workerinput else str(os.getpid())
    return Path(tempfile.gettempdir()) / f"shardmesh-1000-node-runs-{key}"


def session_owner(config: pytest.Config) -> int:
    """The pid whose exit ends the session: xdist's controller, or this process."""
    return os.getppid() if hasattr(config, "workerinput") else os.getpid()


def start_for(session: pytest.Session) -> None:
    """Starts the runs the session's selected tests need, if any and not yet."""
    runs = runs_of(session.items)
    if runs and not session.config.option.collectonly:
        config = session.config
        start_once(session_dir(config), runs, session_owner(config), config.rootpath)


def start_once(where: Path, runs: list[str], owner_pid: int, cwd: Path) -> bool:
    """Starts the runner for `runs` unless this session's already was:
    True when this call started it."""
    try:
        where.mkdir(parents=True)
    except FileExistsError:
        return False
    with (where / LOG_FILE).open("wb") as log:
        runner = subprocess.Popen(
            [sys.executable, "-m", __name__, str(where), str(owner_pid), *runs],
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its pool joins its process group: killed as one
        )
    (where / PID_FILE).write_text(str(runner.pid))
    return True


def finish(where: Path) -> None:
    """Stops the runner if it still runs (a test failed before reading all)
    and removes its directory."""
    try:
        pid = int((where / PID_FILE).read_text())
        if _alive(pid):
            os.killpg(pid, signal.SIGKILL)
    except (FileNotFoundError, ValueError, ProcessLookupError):
        pass
    shutil.rmtree(where, ignore_errors=True)


def _result_file(where: Path, run: str, seed: int) -> Path:
    return where / f"{run}-{seed}.pickle"


def result(where: Path, run: str, seed: int, timeout_s: float) -> Any:
    """The result of `run` for `seed`, waiting for it at most `timeout_s`;
    the runner's exception or log if it failed or died."""
    return _wait_for(where, _result_file(where, run, seed), timeout_s)


def core(where: Path, timeout_s: float) -> Path | None:
    """The compiled core the runs used (None: they ran on the source)."""
    built: Path | None = _wait_for(where, where / CORE_FILE, timeout_s)
    return built


def _wait_for(where: Path, path: Path, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            outcome, value = pickle.loads(path.read_bytes())
            if outcome == "error":
                raise RuntimeError(f"{path.name}: the run raised:\n{value}")
            return value
        if not _runner_alive(where):
            if path.exists():  # written just before the runner exited
                continue
            raise RuntimeError(f"the 1,000-node runner died; its log:\n{_log_tail(where)}")
        time.sleep(POLL_INTERVAL_S)
    raise TimeoutError(f"{path.name} not in after {timeout_s:.0f} s; log:\n{_log_tail(where)}")


def _runner_alive(where: Path) -> bool:
    try:
        pid = int((where / PID_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return True  # the starter is writing it
    return _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A child of this process that exited but was not reaped is a zombie:
    # signal 0 still reaches it.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def _log_tail(where: Path) -> str:
    try:
        return (where / LOG_FILE).read_text(errors="replace")[-4000:]
    except FileNotFoundError:
        return "(no log)"


def _write(path: Path, outcome: str, value: Any) -> None:
    partial = path.with_suffix(".partial")
    partial.write_bytes(pickle.dumps((outcome, value)))
    partial.rename(path)  # atomic: a reader never sees half a file


def _watch_owner(owner_pid: int) -> None:
    """Kills the runner's process group once the session's pytest is gone."""
    while _alive(owner_pid):
        time.sleep(WATCH_INTERVAL_S)
    os.killpg(0, signal.SIGKILL)


def _run(where: Path, runs: list[str]) -> None:
    built = compiled.ensure_built() if shutil.which("cc") else None
    _write(where / CORE_FILE, "ok", built)
    if built is not None:
        os.environ[compiled.ENV_VAR] = str(built)  # the spawned pool loads it
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1, mp_context=context) as pool:
        futures: dict[Future[Any], Path] = {
            pool.submit(RUNS[run][0], seed): _result_file(where, run, seed)
            for run in runs
            for seed in RUNS[run][1]
        }
        for future in as_completed(futures):
            path = futures[future]
            try:
                _write(path, "ok", future.result())
            except Exception:  # the test that reads it shows it
                _write(path, "error", traceback.format_exc())


def main(argv: list[str]) -> int:
    where, owner_pid, runs = Path(argv[0]), int(argv[1]), argv[2:]
    os.nice(NICENESS)  # first: the compiler and the pool inherit it
    threading.Thread(target=_watch_owner, args=(owner_pid,), daemon=True).start()
    _run(where, runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
