"""The fork server (`runtime.cli.forkserver`): a forked node is the process a
spawned one would be - its own argv, environment, working directory, cores,
log, exit code and signals - with the heavy libraries already imported; and
where it cannot be (a different import-time environment, a dead server),
`LocalSwarm` spawns instead."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from runtime.cli import forkserver
from runtime.cli.localswarm import LocalSwarm

CHILD = "tests.runtime.cli.forkserver_child"
BASE_ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def server() -> Iterator[forkserver.ForkServer]:
    started = forkserver.ForkServer(sys.executable, BASE_ENV)
    yield started
    started.close()


def spawn(
    server: forkserver.ForkServer, log: Path, *argv: str, **env: str
) -> forkserver.ForkedProcess:
    return server.spawn(list(argv), {**BASE_ENV, **env}, log, module=CHILD)


async def wait(process: forkserver.ForkedProcess) -> int:
    with trio.fail_after(20):
        return await process.wait()


async def until_logged(log: Path, text: str) -> None:
    with trio.fail_after(20):
        while not log.exists() or text not in log.read_text():
            await trio.sleep(0.02)


async def test_a_forked_child_has_its_own_argv_env_cwd_cores_and_exit_code(
    server: forkserver.ForkServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    core = min(os.sched_getaffinity(0))
    log = tmp_path / "child.log"
    process = server.spawn(
        ["7", "two words"],
        {**BASE_ENV, "FORKSERVER_CHILD_VALUE": "mine"},
        log,
        cpus=frozenset({core}),
        module=CHILD,
    )
    assert await wait(process) == 7
    lines = log.read_text().splitlines()
    assert "argv ['7', 'two words']" in lines
    assert f"cwd {tmp_path}" in lines
    assert "env mine" in lines
    assert f"cpus [{core}]" in lines
    assert "torch loaded True" in lines  # the point: imported once, in the server
    assert process.returncode == 7


async def test_signals_reach_the_child_and_its_code_says_which(
    server: forkserver.ForkServer, tmp_path: Path
) -> None:
    terminated = spawn(server, tmp_path / "term.log", "wait")
    await until_logged(tmp_path / "term.log", "waiting")
    terminated.send_signal(signal.SIGTERM)
    assert await wait(terminated) == 0  # its handler ran, as in any process
    killed = spawn(server, tmp_path / "kill.log", "wait")
    await until_logged(tmp_path / "kill.log", "waiting")
    killed.kill()
    assert await wait(killed) == -signal.SIGKILL  # as subprocess.Popen says it
    killed.kill()  # already gone: nothing happens


async def test_an_exit_with_a_message_prints_it_and_exits_1(
    server: forkserver.ForkServer, tmp_path: Path
) -> None:
    process = spawn(server, tmp_path / "message.log", "message")
    assert await wait(process) == 1
    assert "told to fail" in (tmp_path / "message.log").read_text()


async def test_children_output_is_appended_to_their_log(
    server: forkserver.ForkServer, tmp_path: Path
) -> None:
    log = tmp_path / "node.log"
    log.write_text("earlier run\n")
    assert await wait(spawn(server, log, "0")) == 0
    text = log.read_text()
    assert text.startswith("earlier run\n") and "argv ['0']" in text


def test_a_child_that_needs_other_import_time_settings_gets_another_server() -> None:
    def shares(**changed: str) -> bool:
        return forkserver.server_key(sys.executable, {**BASE_ENV, **changed}) == (
            forkserver.server_key(sys.executable, BASE_ENV)
        )

    assert shares(SHARDMESH_ANYTHING="x")  # read at run time, from the child's own environment
    assert not shares(OMP_NUM_THREADS="4")  # libgomp read it when torch loaded
    assert not shares(PYTHONHASHSEED="1")
    assert not shares(HF_ENDPOINT="http://127.0.0.1:1")  # the hub library's, at import
    # tests/fault_hooks' sitecustomize plants a fault when the interpreter starts
    assert not shares(SHARDMESH_TEST_FAULT="slow_hop:0.05")


async def test_a_dead_server_refuses_and_the_swarm_spawns_instead(tmp_path: Path) -> None:
    server = forkserver.ForkServer(sys.executable, BASE_ENV)
    server._process.kill()
    server._process.wait()
    with pytest.raises(forkserver.ForkServerError):
        server.spawn(["0"], BASE_ENV, tmp_path / "never.log", module=CHILD)


async def test_a_swarm_forks_its_nodes_and_spawns_the_ones_that_ask(tmp_path: Path) -> None:
    async with LocalSwarm(tmp_path / "swarm") as swarm:
        forked = swarm.new_node("forked")
        spawned = swarm.new_node("spawned", forked=False)
        await swarm.start_ready(forked, timeout=60)
        await swarm.start_ready(spawned, [forked.seed], timeout=60)
        assert isinstance(forked.process, forkserver.ForkedProcess)
        assert isinstance(spawned.process, trio.Process)
        assert [await swarm.stop(node) for node in (spawned, forked)] == [0, 0]
