"""Chats per HTTP client (`runtime.api.quota`): one client cannot take a
node's whole chat capacity, and a stream holds its slot until it ends.

The quota core is tested directly; then the real app (`create_app`) over
real HTTP (hypercorn on loopback, as the node serves it) with a stand-in
chat service whose streams stay open until the test lets them finish; then
(slow) a real node process serving a tiny model. The second client has
another source address: 127.0.0.2, which Linux routes over loopback.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
import trio

from runtime.api.app import NodeAPI, create_app
from runtime.api.quota import (
    MAX_CONCURRENT_PER_CLIENT,
    MAX_CONCURRENT_TOTAL,
    REASON_CLIENT,
    REASON_TOTAL,
    RETRY_AFTER_S,
    ChatQuota,
    client_key,
)
from runtime.cli.localswarm import LocalSwarm
from runtime.cli.main import build_parser
from runtime.inference.chat import (
    OUTCOME_CANCELLED,
    OUTCOME_CLIENT_ERROR,
    OUTCOME_OK,
    OUTCOME_RATE_LIMITED,
    ChatRequest,
    Generation,
)
from tests.swarm_helpers import start_tiny_model_node

second_loopback = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="a second loopback source address is Linux's"
)

OTHER_CLIENT = "127.0.0.2"
STREAMS = 40

# --- the core -----------------------------------------------------------------------


def test_a_client_gets_its_share_and_others_still_get_theirs() -> None:
    quota = ChatQuota(per_client=2, total=3)
    assert quota.acquire("a") is None and quota.acquire("a") is None
    refusal = quota.acquire("a")
    assert refusal is not None and refusal.reason == REASON_CLIENT
    assert refusal.retry_after_s == RETRY_AFTER_S
    assert quota.acquire("b") is None
    busy = quota.acquire("c")  # the node's bound, whoever asks
    assert busy is not None and busy.reason == REASON_TOTAL
    assert (quota.in_flight("a"), quota.in_flight(), quota.clients()) == (2, 3, 2)
    quota.release("a")
    assert quota.acquire("c") is None
    for client in ("a", "b", "c"):
        quota.release(client)
    assert (quota.in_flight(), quota.clients()) == (0, 0)  # idle clients are forgotten
    with pytest.raises(RuntimeError):
        quota.release("a")


def test_the_defaults_leave_room_for_others() -> None:
    assert 1 <= MAX_CONCURRENT_PER_CLIENT < MAX_CONCURRENT_TOTAL
    assert MAX_CONCURRENT_PER_CLIENT * 4 <= 16  # a hop's default session slots
    with pytest.raises(ValueError):
        ChatQuota(per_client=0)


@pytest.mark.parametrize(
    ("host", "key"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("2001:db8::1", "2001:db8::/64"),
        ("2001:db8::ffff:1", "2001:db8::/64"),  # same /64: one client
        ("2001:db8:0:1::1", "2001:db8:0:1::/64"),
        ("::ffff:10.0.0.7", "10.0.0.7"),
        (None, "unknown"),
        ("testclient", "testclient"),
    ],
)
def test_clients_are_ip_addresses_or_ipv6_64s(host: str | None, key: str) -> None:
    assert client_key(host) == key


def test_the_node_flag_documents_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    node = build_parser().parse_args(["node", "--listen", "127.0.0.1:0"])
    assert node.max_chats_per_client is None  # the API's default applies
    with pytest.raises(SystemExit):
        build_parser().parse_args(["node", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--max-chats-per-client N" in help_text
    assert f"default {MAX_CONCURRENT_PER_CLIENT};" in help_text


# --- the real app over real HTTP ------------------------------------------------------


class HeldChat:
    """A stand-in `ChatService`: model "held" streams one delta, then waits
    for `finish`; any other model answers at once."""

    def __init__(self) -> None:
        self.counters: dict[str, int] = {}
        self.outcomes: Counter[str] = Counter()
        self.finish = trio.Event()
        self.open = 0
        self.closed = 0

    async def start(self, request: ChatRequest) -> tuple[Generation, AsyncGenerator[str, None]]:
        generation = Generation(id="chatcmpl-1", model=request.model, created=0, prompt_tokens=1)
        return generation, self._deltas(request.model, generation)

    async def _deltas(self, model: str, generation: Generation) -> AsyncGenerator[str, None]:
        self.open += 1
        try:
            yield "hello"
            if model == "held":
                await self.finish.wait()
            yield " world"
            generation.finish_reason = "stop"
        finally:
            self.open -= 1
            self.closed += 1

    def models(self) -> list[dict[str, Any]]:
        return []


class Counters(dict[str, int]):
    def __missing__(self, key: str) -> int:
        return 0


@asynccontextmanager
async def serve_app(chat: HeldChat, **app_kwargs: Any) -> AsyncIterator[str]:
    """The node's app with `chat`, served by hypercorn on loopback; its URL."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    chat.counters = Counters()
    node = cast(NodeAPI, SimpleNamespace(chat=chat))
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.graceful_timeout = 0.5
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        app: Any = create_app(node, **app_kwargs)
        binds = await nursery.start(partial(serve, app, config, shutdown_trigger=shutdown.wait))
        try:
            yield binds[0]
        finally:
            chat.finish.set()
            shutdown.set()


def chat_body(model: str, *, stream: bool) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}


def other_client(**kwargs: Any) -> httpx.AsyncClient:
    transport = httpx.AsyncHTTPTransport(local_address=OTHER_CLIENT)
    return httpx.AsyncClient(transport=transport, **kwargs)


def assert_rate_limited(status: int, headers: httpx.Headers, body: dict[str, Any]) -> None:
    assert status == 429
    assert headers["retry-after"] == str(RETRY_AFTER_S)
    error = body["error"]
    assert error["code"] == "rate_limit_exceeded" and error["reason"] == REASON_CLIENT
    assert set(error) >= {"message", "type", "param", "code"}


async def open_streams(
    client: httpx.AsyncClient,
    url: str,
    count: int,
    model: str,
    results: list[tuple[int, httpx.Headers, dict[str, Any]]],
    done: trio.Event,
    hold: trio.Event,
) -> None:
    """`count` concurrent streamed chats; each records (status, headers,
    error body); the 200s read their first event and stay open until `hold`."""
    async with trio.open_nursery() as nursery:

        async def one() -> None:
            body = chat_body(model, stream=True)
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    results.append((r.status_code, r.headers, json.loads(await r.aread())))
                else:
                    lines = r.aiter_lines()
                    first = await anext(lines)
                    assert first.startswith("data: ")
                    results.append((200, r.headers, {}))
                if len(results) == count:
                    done.set()
                if r.status_code == 200:
                    await hold.wait()
                    async for _ in lines:
                        pass

        for _ in range(count):
            nursery.start_soon(one)


@second_loopback
async def test_one_client_with_40_streams_gets_429s_while_another_is_served() -> None:
    chat = HeldChat()
    async with serve_app(chat) as url, httpx.AsyncClient(timeout=10) as mine:
        results: list[tuple[int, httpx.Headers, dict[str, Any]]] = []
        all_answered, hold = trio.Event(), trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                open_streams, mine, url, STREAMS, "held", results, all_answered, hold
            )
            with trio.fail_after(10):
                await all_answered.wait()
            statuses = sorted(status for status, _, _ in results)
            assert statuses == [200] * MAX_CONCURRENT_PER_CLIENT + [429] * (
                STREAMS - MAX_CONCURRENT_PER_CLIENT
            )
            for result in results:
                if result[0] == 429:
                    assert_rate_limited(*result)
            assert chat.open == MAX_CONCURRENT_PER_CLIENT  # the load is still running
            async with other_client(timeout=10) as theirs:
                answer = await theirs.post(
                    f"{url}/v1/chat/completions", json=chat_body("quick", stream=False)
                )
                assert answer.status_code == 200, answer.text
                assert answer.json()["choices"][0]["message"]["content"] == "hello world"
                body = chat_body("quick", stream=True)
                async with theirs.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    assert (await r.aread()).endswith(b"data: [DONE]\n\n")
            assert chat.open == MAX_CONCURRENT_PER_CLIENT
            refused = STREAMS - MAX_CONCURRENT_PER_CLIENT
            assert chat.counters == {f"refused_{REASON_CLIENT}": refused}
            assert chat.outcomes[OUTCOME_RATE_LIMITED] == refused
            chat.finish.set()
            hold.set()
        assert chat.open == 0
        # Streams that ended gave their slots back: the client has its share again.
        again = await mine.post(f"{url}/v1/chat/completions", json=chat_body("held", stream=False))
        assert again.status_code == 200
        # Each request counted once by how it ended (a stream once its response is over).
        answered = MAX_CONCURRENT_PER_CLIENT + 3  # the held streams, theirs two, this one
        with trio.fail_after(5):
            while chat.outcomes[OUTCOME_OK] < answered:
                await trio.sleep(0.01)
        assert chat.outcomes == {
            OUTCOME_RATE_LIMITED: STREAMS - MAX_CONCURRENT_PER_CLIENT,
            OUTCOME_OK: answered,
        }


async def test_a_client_that_walks_away_gets_its_slots_back() -> None:
    chat = HeldChat()
    async with serve_app(chat) as url, httpx.AsyncClient(timeout=10) as mine:
        for _ in range(3):  # more abandoned streams than the share: none may leak
            results: list[tuple[int, httpx.Headers, dict[str, Any]]] = []
            done, hold = trio.Event(), trio.Event()
            with trio.move_on_after(10) as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(
                        open_streams,
                        mine,
                        url,
                        MAX_CONCURRENT_PER_CLIENT,
                        "held",
                        results,
                        done,
                        hold,
                    )
                    await done.wait()
                    assert [status for status, _, _ in results] == [200] * MAX_CONCURRENT_PER_CLIENT
                    nursery.cancel_scope.cancel()  # the client hangs up mid-stream
            assert not scope.cancelled_caught
            with trio.fail_after(5):  # the server notices the disconnects
                while chat.open or chat.outcomes.total() < chat.closed:
                    await trio.sleep(0.01)
        assert chat.closed == 3 * MAX_CONCURRENT_PER_CLIENT
        assert chat.outcomes == {OUTCOME_CANCELLED: chat.closed}  # each stream counted once
        answer = await mine.post(
            f"{url}/v1/chat/completions", json=chat_body("quick", stream=False)
        )
        assert answer.status_code == 200


async def test_a_refused_or_failed_chat_gives_its_slot_back() -> None:
    chat = HeldChat()
    async with serve_app(chat, chats_per_client=1) as url, httpx.AsyncClient(timeout=10) as mine:
        for _ in range(3):  # a bad body is answered 400, and the slot is free again
            bad = await mine.post(f"{url}/v1/chat/completions", json={"model": "quick"})
            assert bad.status_code == 400
        results: list[tuple[int, httpx.Headers, dict[str, Any]]] = []
        done, hold = trio.Event(), trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(open_streams, mine, url, 1, "held", results, done, hold)
            await done.wait()
            second = await mine.post(
                f"{url}/v1/chat/completions", json=chat_body("quick", stream=False)
            )
            assert second.status_code == 429  # the flag's limit: one
            assert chat.outcomes == {OUTCOME_CLIENT_ERROR: 3, OUTCOME_RATE_LIMITED: 1}
            chat.finish.set()
            hold.set()


# --- a real node process ---------------------------------------------------------------

MODEL = "tiny"
LONG_TOKENS = 64
"""Long enough that the first client's streams still run when the other asks
(measured: they ran ~2 s past the refusals; the other's answer began in ~15 ms)."""


@second_loopback
@pytest.mark.slow
async def test_a_node_serves_another_client_while_one_floods_it(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    node = await start_tiny_model_node(swarm, tmp_path, MODEL)
    url = node.api + "/v1/chat/completions"
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about the swarm of volunteers."}],
        "max_tokens": LONG_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    statuses: list[int] = []
    refusals: list[tuple[int, httpx.Headers, dict[str, Any]]] = []
    streaming = [0]
    answered = trio.Event()

    async def flood_one(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", url, json=body) as r:
            statuses.append(r.status_code)
            if r.status_code == 200:
                streaming[0] += 1
            else:
                refusals.append((r.status_code, r.headers, json.loads(await r.aread())))
            if len(statuses) == STREAMS:
                answered.set()
            text = (await r.aread()).decode()
            if r.status_code == 200:
                streaming[0] -= 1
                assert text.endswith("data: [DONE]\n\n"), text[-300:]

    async with (
        httpx.AsyncClient(timeout=120) as mine,
        other_client(timeout=120) as theirs,
        trio.open_nursery() as nursery,
    ):
        for _ in range(STREAMS):
            nursery.start_soon(flood_one, mine)
        with trio.fail_after(60):
            await answered.wait()
        assert statuses.count(200) == MAX_CONCURRENT_PER_CLIENT, statuses
        assert statuses.count(429) == STREAMS - MAX_CONCURRENT_PER_CLIENT, statuses
        for refusal in refusals:
            assert_rate_limited(*refusal)
        async with theirs.stream("POST", url, json=body) as r:
            assert r.status_code == 200, await r.aread()
            assert streaming[0] > 0, "the flood ended before the other client asked"
            assert (await r.aread()).endswith(b"data: [DONE]\n\n")
    status = (await swarm.views([node]))[node.name]
    assert status is not None
    assert status["chat"][f"refused_{REASON_CLIENT}"] == STREAMS - MAX_CONCURRENT_PER_CLIENT
    assert status["chat"]["completed"] == MAX_CONCURRENT_PER_CLIENT + 1
