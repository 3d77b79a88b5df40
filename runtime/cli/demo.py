"""`shardmesh demo` (what `make demo` runs): a local swarm on loopback.

It makes a tiny random Qwen3-architecture model (8 layers, a real
tokenizer), starts real node processes — the first three each serve a third
of the model ([0,3), [3,6), [6,8)), the rest join model-less — and prints
who-sees-whom as the swarm converges and elects a Raft leader. Once every
shard has passed its doctor, it streams a chat answer through the chain,
exactly as `shardmesh chat` would. Then it SIGKILLs a model-less node and
shows every survivor declare it dead (against the profile's documented
bound), stops one node gracefully to show a `left`, then stops the rest and
checks they all exit 0. Every wait is bounded; any failure prints the
relevant node logs and exits 1.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from runtime.cli.chat_client import ChatClientError, stream_chat
from runtime.cli.localswarm import (
    STOP_TIMEOUT_S,
    LocalNode,
    LocalSwarm,
    SwarmError,
    all_see,
    dead_bound,
    state_matrix,
)
from runtime.cli.status_view import format_status

CONVERGE_TIMEOUT_S = 30.0
NODE_START_TIMEOUT_S = 45.0
"""One node's process up and serving its API: imports (torch among them)
take 2-3 s on a quiet machine and over 10 s beside a CPU-heavy job. The
nodes start one after another, so full membership is awaited for this
per node plus CONVERGE_TIMEOUT_S."""
SERVE_TIMEOUT_S = 90.0  # three doctors and a torch import each, on a busy CPU
MODEL = "tiny-qwen3"
SECOND_MODEL = "tiny-llama"  # in node3's store only: placed there on demand
SHARDS = ("0:3", "3:6", "6:8")
PROMPT = "Say hello to the swarm."
ANSWER_TOKENS = 24
POLL_S = 0.2
# Slack on top of the documented bound for process scheduling and polling.
BOUND_SLACK_S = 2.0


def _say(text: str = "") -> None:
    print(text, flush=True)


async def watch(
    swarm: LocalSwarm,
    observers: Sequence[LocalNode],
    shown: Sequence[LocalNode],
    done: Callable[[dict[str, dict[str, Any] | None]], bool],
    timeout: float,
    started: float,
) -> float:
    """Poll the observers until `done(views)`, printing the state matrix each
    time it changes; returns seconds since `started`."""
    last = None
    with trio.move_on_after(timeout):
        while True:
            views = await swarm.views(observers)
            matrix = state_matrix(shown, views)
            if matrix != last and "\n" in matrix:  # a header alone says nothing
                _say(f"t+{trio.current_time() - started:5.2f}s")
                _say(matrix)
                last = matrix
            if done(views):
                return trio.current_time() - started
            await trio.sleep(POLL_S)
    raise SwarmError(f"condition not reached within {timeout:.1f}s")


async def demo(root: Path, nodes: int, profile: str) -> None:
    from runtime.model.tiny import make_tiny_model

    model_dir = await trio.to_thread.run_sync(
        lambda: make_tiny_model(root / MODEL, layers=8, name=MODEL)
    )
    store = root / "store"
    await trio.to_thread.run_sync(
        lambda: make_tiny_model(store / SECOND_MODEL, layers=4, family="llama", name=SECOND_MODEL)
    )

    def args(i: int) -> list[str]:
        if i < len(SHARDS):
            return ["--model", str(model_dir), "--layers", SHARDS[i]]
        return ["--models", str(store)] if i == len(SHARDS) else []

    async with LocalSwarm(root / "swarm", profile=profile) as swarm:
        members = [swarm.new_node(args=args(i)) for i in range(nodes)]
        try:
            await _demo(swarm, members, profile)
        except BaseException:
            for node in members:
                _say(f"--- log of {node.name} ({node.log_path}) ---")
                _say(node.log_tail(25))
            raise


async def _demo(swarm: LocalSwarm, members: list[LocalNode], profile: str) -> None:
    """The demo's story, step by step; any step that fails raises SwarmError."""
    _introduce(swarm, members, profile)
    await _converge(swarm, members)
    await _chat(swarm, members)
    placed = len(members) > len(SHARDS)
    if placed:
        await _place_on_demand(swarm, members)
    await _operator_call(members[0])
    await _show_status(swarm, members, placed)
    survivors = await _kill_one(swarm, members, profile)
    remaining = await _leave_one(swarm, members, survivors)
    await _stop_the_rest(swarm, remaining)


def _introduce(swarm: LocalSwarm, members: list[LocalNode], profile: str) -> None:
    _say(f"starting {len(members)} nodes on 127.0.0.1 (profile {profile}) under {swarm.root}")
    _say(
        f"{', '.join(m.name for m in members[: len(SHARDS)])} serve layers "
        f"{', '.join(SHARDS)} of the 8-layer {MODEL}; the others join model-less"
        f" ({members[len(SHARDS)].name} with {SECOND_MODEL} in its --models store)"
        if len(members) > len(SHARDS)
        else ""
    )
    _say(
        "each joins through the node started before it (--join ID@HOST:PORT: both planes are "
        "CurveZMQ, encrypted to the key that is the node's id); the matrix shows who sees whom"
    )
    _say("(rows: observer, columns: subject; A alive S suspect D dead L left . unknown)")


async def _converge(swarm: LocalSwarm, members: list[LocalNode]) -> None:
    """Start the nodes one after another, each joining through the one
    before, while the matrix shows them converge to full membership."""
    t0 = trio.current_time()
    started = trio.Event()

    async def start_all() -> None:
        previous: LocalNode | None = None
        for node in members:
            joins = [previous.seed] if previous else []
            await swarm.start_ready(node, joins, timeout=NODE_START_TIMEOUT_S)
            via = f" via {previous.name}" if previous else ""
            _say(
                f"  {node.name} {node.node_id[:12]} up{via}: control {node.control} api {node.api}"
            )
            previous = node
        started.set()

    everyone_alive = all_see(members, members, "alive")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(start_all)
        took = await watch(
            swarm,
            members,
            members,
            lambda views: started.is_set() and everyone_alive(views),
            CONVERGE_TIMEOUT_S + len(members) * NODE_START_TIMEOUT_S,
            t0,
        )
    _say(f"full membership at every node {took:.2f}s after the first start")


async def _show_status(swarm: LocalSwarm, members: list[LocalNode], placed: bool) -> None:
    """`shardmesh status` of the first node. What it reports reached it
    from the others: the shards' reports by gossip (the waits before were on
    another node), the placed assignment by Raft replication."""
    await swarm.wait_for(
        members[:1],
        lambda views: _shows(views.get(members[0].name), placed),
        CONVERGE_TIMEOUT_S,
        f"{members[0].name}'s view of the coverage and the ledger",
    )
    _say()
    view = await swarm.status(members[0])
    assert view is not None
    _say(f"$ shardmesh status --api {members[0].api}")
    _say(format_status(view))


async def _kill_one(swarm: LocalSwarm, members: list[LocalNode], profile: str) -> list[LocalNode]:
    """SIGKILL the last node and time its detection against the profile's
    documented bound; returns the survivors."""
    victim, survivors = members[-1], members[:-1]
    bound = dead_bound(profile, len(members))
    _say()
    _say(f"SIGKILL {victim.name} ({victim.node_id[:12]}); documented bound {bound:.2f}s")
    t0 = trio.current_time()
    victim.kill()
    await victim.wait_exit(5)
    took = await watch(
        swarm,
        survivors,
        members,
        all_see(survivors, [victim], "dead"),
        bound + BOUND_SLACK_S,
        t0,
    )
    verdict = "within" if took <= bound else "OVER"
    _say(f"every survivor declared {victim.name} dead after {took:.2f}s ({verdict} {bound:.2f}s)")
    if took > bound:
        raise SwarmError(f"detection took {took:.2f}s, over the documented {bound:.2f}s")
    return survivors


async def _leave_one(
    swarm: LocalSwarm, members: list[LocalNode], survivors: list[LocalNode]
) -> list[LocalNode]:
    """SIGTERM the last survivor: a graceful leave, seen as `left`; returns the rest."""
    leaver, remaining = survivors[-1], survivors[:-1]
    _say()
    _say(f"SIGTERM {leaver.name}: a graceful leave")
    t0 = trio.current_time()
    leaver.signal(15)
    took = await watch(
        swarm, remaining, members, all_see(remaining, [leaver], "left"), CONVERGE_TIMEOUT_S, t0
    )
    code = await leaver.wait_exit(STOP_TIMEOUT_S)
    _say(f"every remaining node shows {leaver.name} left after {took:.2f}s; exit code {code}")
    if code != 0:
        raise SwarmError(f"{leaver.name} exited {code} after SIGTERM")
    return remaining


async def _stop_the_rest(swarm: LocalSwarm, remaining: list[LocalNode]) -> None:
    """SIGTERM the rest side by side; every one must exit 0."""
    _say()
    _say(f"stopping {', '.join(n.name for n in remaining)} (SIGTERM)")
    codes: dict[str, int] = {}

    async def stop(node: LocalNode) -> None:
        codes[node.name] = await swarm.stop(node)

    async with trio.open_nursery() as nursery:
        for node in remaining:
            nursery.start_soon(stop, node)
    for node in remaining:
        if node.escalated is not None:
            late = f"was still stopping after {STOP_TIMEOUT_S:.0f} s"
            _say(f"  {node.name} {late}: sent {node.escalated}")
    _say("exit codes: " + ", ".join(f"{name}={code}" for name, code in sorted(codes.items())))
    if any(codes.values()):
        raise SwarmError("a node did not exit cleanly")


def _shows(view: dict[str, Any] | None, placed: bool) -> bool:
    """`view` has the whole model covered and, if `placed`, the assignment."""
    view = view or {}
    coverage = view.get("coverage", {}).get(MODEL)
    assigned = any(entry["model"] == SECOND_MODEL for entry in view.get("ledger", []))
    return bool(coverage) and not coverage["gaps"] and (assigned or not placed)


async def _chat(swarm: LocalSwarm, members: list[LocalNode]) -> None:
    """Wait until every shard is admitted (a complete chain), then stream an
    answer through a node that holds no shard of the model."""
    _say()
    _say("waiting for each shard's doctor (a real forward against golden activations) ...")

    def complete(views: dict[str, dict[str, Any] | None]) -> bool:
        view = views.get(members[-1].name) or {}
        coverage = view.get("coverage", {}).get(MODEL)
        return bool(coverage) and not coverage["gaps"] and view.get("leader") is not None

    t0 = trio.current_time()
    with trio.move_on_after(SERVE_TIMEOUT_S):
        while not complete(await swarm.views(members[-1:])):
            await trio.sleep(POLL_S)
    view = await swarm.status(members[-1])
    if view is None or not complete({members[-1].name: view}):
        raise SwarmError(f"{MODEL} was not fully served within {SERVE_TIMEOUT_S:.0f}s")
    _say(
        f"{MODEL} fully covered after {trio.current_time() - t0:.2f}s; "
        f"Raft leader {view['leader'][:12]} (term {view['term']})"
    )
    entry = members[-1]
    _say(f'$ shardmesh chat --api {entry.api} --model {MODEL} "{PROMPT}"')
    _say("(a random model: the words are noise, the path is real: entry -> 3 hops -> entry)")
    try:
        result = await stream_chat(
            entry.api,
            MODEL,
            PROMPT,
            max_tokens=ANSWER_TOKENS,
            temperature=0,
            on_text=lambda text: print(text, end="", flush=True),
        )
    except ChatClientError as exc:
        raise SwarmError(f"chat failed: {exc}") from exc
    _say()
    usage = result.usage or {}
    _say(
        f"[{result.finish_reason}: {usage.get('completion_tokens')} tokens streamed through "
        f"{', '.join(m.name for m in members[: len(SHARDS)])}]"
    )
    if not result.text:
        raise SwarmError("the chat answer was empty")
    timing = (result.shardmesh or {}).get("timing") or {}
    if timing.get("decode_ms_per_token") is not None:
        hops = " + ".join(f"{hop['decode_ms_per_step']:.2f}" for hop in timing["hops"])
        _say(
            f"where the time went: first token {timing['ttft_ms']:.0f} ms; each later token "
            f"{timing['decode_ms_per_token']:.2f} ms = hops' compute {hops} ms + "
            f"{timing['decode_ms_beyond_compute']:.2f} ms messaging and entry"
        )


async def _place_on_demand(swarm: LocalSwarm, members: list[LocalNode]) -> None:
    """Ask for a model nobody serves: 503 model_loading, the leader places
    it on the spare node that has it, its doctor admits it, and it answers."""
    import httpx

    entry = members[0]
    body = {
        "model": SECOND_MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 8,
        "temperature": 0,
    }
    spare = members[len(SHARDS)]

    def knows_store(views: dict[str, dict[str, Any] | None]) -> bool:
        members_seen = (views.get(entry.name) or {}).get("members", [])
        return any(
            m["node_id"] == spare.node_id
            and SECOND_MODEL in ((m["record"] or {}).get("models") or [])
            for m in members_seen
        )

    # Until the spare node's record (its store) reaches the entry by gossip,
    # the entry has never heard of the model: 404, not 503.
    await swarm.wait_for(
        [entry], knows_store, CONVERGE_TIMEOUT_S, f"{spare.name}'s store known to {entry.name}"
    )
    _say()
    _say(f"asking {entry.name} for {SECOND_MODEL}, which no node serves yet ...")
    t0 = trio.current_time()
    async with httpx.AsyncClient(timeout=60) as client:
        first = await client.post(entry.api + "/v1/chat/completions", json=body)
        error = first.json().get("error", {})
        _say(
            f"  HTTP {first.status_code} {error.get('type')}: {error.get('message')} "
            f"(Retry-After {first.headers.get('retry-after')} s; waiting for "
            f"{error.get('coverage', {}).get('waiting_for')})"
        )
        with trio.move_on_after(SERVE_TIMEOUT_S):
            while True:
                await trio.sleep(POLL_S)
                retry = await client.post(entry.api + "/v1/chat/completions", json=body)
                if retry.status_code == 200:
                    break
        if retry.status_code != 200:
            raise SwarmError(f"{SECOND_MODEL} was not placed within {SERVE_TIMEOUT_S:.0f}s")
    view = await swarm.status(entry)
    assert view is not None
    placed = [d for d in view["placement"]["decisions"] if d.get("model") == SECOND_MODEL]
    for decision in placed:
        _say(f"  leader: {decision['command']} {SECOND_MODEL}: {decision['reason']}")
    _say(
        f"  retried after {trio.current_time() - t0:.2f}s: HTTP 200 through "
        f"{retry.json()['shardmesh']['route'][0][:12]} ({members[len(SHARDS)].name}, managed)"
    )


async def _operator_call(node: LocalNode) -> None:
    """A call that changes the swarm: refused without the node's operator
    token, committed with it (read from the node's state dir, as
    `shardmesh policy --state-dir` does)."""
    import httpx

    url, setting = node.api + "/v1/network/policy", {"idle_release_s": 1800}
    _say()
    _say(f"changing the swarm needs {node.name}'s operator token (in its state dir):")
    async with httpx.AsyncClient(timeout=30) as client:
        refused = await client.post(url, json=setting)
        _say(f"  without it: HTTP {refused.status_code} {refused.json()['error']['code']}")
        if refused.status_code != 401:
            raise SwarmError(f"an admin call without the token got HTTP {refused.status_code}")
        _say(f"$ shardmesh policy --api {node.api} --state-dir DIR --set idle_release_s=1800")
        changed = refused
        with trio.move_on_after(CONVERGE_TIMEOUT_S):
            while True:
                changed = await client.post(url, json=setting, headers=node.admin_headers())
                if changed.status_code != 503:
                    break
                await trio.sleep(POLL_S)
    answer = changed.json()
    if changed.status_code != 200 or not answer.get("accepted"):
        raise SwarmError(f"the policy change was refused: HTTP {changed.status_code} {answer}")
    _say(f"  committed at index {answer['index']} by leader {answer['leader'][:12]}")


def run_demo(*, nodes: int = 5, profile: str = "local", keep: bool = False) -> int:
    """The body of `shardmesh demo`; returns the exit code."""
    root = Path(tempfile.mkdtemp(prefix="shardmesh-demo-"))
    try:
        trio.run(demo, root, nodes, profile)
    except (SwarmError, AssertionError) as exc:
        _say(f"demo FAILED: {exc}")
        return 1
    except BaseExceptionGroup as group:
        # Steps that run side by side (stopping the nodes) fail as a group.
        failed, other = group.split((SwarmError, AssertionError))
        if failed is None or other is not None:
            raise
        for failure in failed.exceptions:
            _say(f"demo FAILED: {failure}")
        return 1
    except KeyboardInterrupt:
        _say("demo interrupted")
        return 130
    finally:
        if keep:
            _say(f"state dirs and logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    _say("demo ok")
    return 0


if __name__ == "__main__":
    sys.exit(run_demo())
