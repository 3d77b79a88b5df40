"""The web page every node serves at `GET /`, in a real headless browser.

Debian's chromium (`make test` installs it where missing) driven by
Playwright's Python API; Playwright's own browsers are never downloaded. One
swarm of real node processes on loopback: a tiny model served in three hops,
and a fourth node serving a model whose name is an XSS payload (the record
schema accepts it: a model name need only be printable). Through the page of
the first hop:

* the swarm view lists the members with the leader marked, ages in words and
  measured speeds, and draws each model's layers with their replicas;
* the peer's model name shows as text everywhere (picker, strip, table) and
  never becomes markup: no `<img>` in the page, its `onerror` never ran;
* the chat box streams an answer from the three hops, identical to the same
  request answered in one piece; Stop ends a stream (the node counts it
  cancelled);
* after the middle hop is killed (SIGKILL) the strip shows the gap, its row
  fades, then drops; a chat then waits on the 503 `model_loading` with the
  coverage shown, and retries after its Retry-After.

Screenshots of each step are kept in test-artifacts/web-page/. The page's files
and their route, in process: tests/runtime/api/test_page.py.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from runtime.cli.localswarm import LocalNode, LocalSwarm, Views
from runtime.model.tiny import make_tiny_model
from tests import REPO
from tests.swarm_helpers import ADMIT_TIMEOUT_S, START_TIMEOUT_S, wait_for

MODEL = "tiny"
XSS_NAME = "<img src=x onerror=window.__xss=1>"
PROMPT = "Tell me about the swarm of volunteers."
ANSWER_TOKENS = 24
GAP = "layers 3\u20135"
"""How the page words the killed hop's layers [3, 6) (with an en dash)."""
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",  # CI runs as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DROP_AFTER_S = 8
"""The page's `?drop_after_s`: how long a dead member stays, faded."""
UI_TIMEOUT_MS = 20_000
"""Any one thing the page should show: a status poll is 2 s, death on the
local profile a few seconds, a chat of a few dozen tokens about one."""
ARTIFACTS = REPO / "test-artifacts" / "web-page"


def find_chromium() -> str | None:
    """Debian's chromium ($CHROMIUM overrides), or None."""
    for candidate in (os.environ.get("CHROMIUM"), "/usr/bin/chromium", "chromium"):
        if candidate and (path := shutil.which(candidate)):
            return path
    return None


@pytest.fixture
def chromium() -> str:
    path = find_chromium()
    if path is None:
        # Not a skip: the page's acceptance is this test, and `make test`
        # installs chromium, so a missing browser is a broken setup.
        pytest.fail(
            "no chromium found (/usr/bin/chromium, or $CHROMIUM): `make test` installs "
            "Debian's with apt-get where it can; install it to run the browser test"
        )
    return path


def both_served(views: Views, observer: LocalNode) -> bool:
    coverage = (views.get(observer.name) or {}).get("coverage", {})
    return all(name in coverage and not coverage[name]["gaps"] for name in (MODEL, XSS_NAME))


@pytest.mark.slow
async def test_the_page_chats_through_three_hops_shows_gaps_and_keeps_peers_strings_as_text(
    chromium: str, swarm: LocalSwarm, tmp_path: Path
) -> None:
    tiny = await trio.to_thread.run_sync(
        lambda: make_tiny_model(tmp_path / "models" / MODEL, layers=8, name=MODEL)
    )
    xss = await trio.to_thread.run_sync(
        lambda: make_tiny_model(tmp_path / "models" / "xss", layers=2, name=XSS_NAME)
    )
    hops = [
        swarm.new_node(f"hop{i}", args=["--model", str(tiny), "--layers", span])
        for i, span in enumerate(("0:3", "3:6", "6:8"))
    ]
    peer = swarm.new_node("xss-peer", args=["--model", str(xss), "--layers", "0:2"])
    entry = hops[0]
    await swarm.start_ready(entry, timeout=START_TIMEOUT_S)
    await swarm.start_many([*hops[1:], peer], [entry.seed], timeout=START_TIMEOUT_S)
    await wait_for(
        swarm, [entry], lambda v: both_served(v, entry), ADMIT_TIMEOUT_S, "both models served"
    )
    async with httpx.AsyncClient(timeout=30) as client:
        reply = await client.post(entry.api + "/v1/chat/completions", json=chat_body())
    assert reply.status_code == 200, reply.text
    expected = reply.json()["choices"][0]["message"]["content"]
    assert expected

    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    await trio.to_thread.run_sync(browse, chromium, entry, hops[1], peer, expected)


def chat_body() -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": ANSWER_TOKENS,
        "temperature": 0,
    }


def browse(
    chromium: str, entry: LocalNode, victim: LocalNode, peer: LocalNode, expected: str
) -> None:
    """The browser's part, in a worker thread (Playwright's sync API)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright, tempfile.TemporaryDirectory() as profile:
        context = playwright.chromium.launch_persistent_context(
            profile,  # a fresh user-data-dir
            executable_path=chromium,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000},
        )
        page = context.new_page()
        page.set_default_timeout(UI_TIMEOUT_MS)
        requested: list[str] = []
        errors: list[str] = []
        page.on("request", lambda request: requested.append(request.url))
        page.on("pageerror", lambda error: errors.append(str(error)))
        try:
            page.goto(f"{entry.api}/?drop_after_s={DROP_AFTER_S}")
            check_swarm_view(page, entry, peer)
            check_chat(page, entry, expected)
            check_gap(page, victim)
            check_loading_wait(page, victim)
        except BaseException:
            page.screenshot(path=ARTIFACTS / "failure.png", full_page=True)
            raise
        finally:
            context.close()
    assert not errors, errors
    outside = [url for url in requested if not url.startswith(entry.api + "/")]
    assert not outside, f"the page fetched from outside its node: {outside}"


def check_swarm_view(page: Any, entry: LocalNode, peer: LocalNode) -> None:
    from playwright.sync_api import expect

    members = page.locator("tr.member")
    expect(members).to_have_count(4)
    expect(page.locator("tr.member.state-alive")).to_have_count(4)
    leader = page.locator("tr.member.leader")
    expect(leader).to_have_count(1)
    assert leader.get_attribute("data-node") == entry.node_id  # the founder, the only voter
    expect(leader.locator(".leader-mark")).to_have_text("★ leader")
    for age in page.locator("tr.member:not(:has(.badge.self)) td:nth-child(3)").all_text_contents():
        assert re.fullmatch(r"just now|\d+ s ago|\d+ min ago", age), age
    expect(page.locator("tr.member td:nth-child(6)").first).to_contain_text("tok/s")
    # Peers dialled the entry back (runtime/node/reachability_driver.py), in words.
    control = "tcp://" + entry.seed.split("@", 1)[1]
    expect(page.locator("#summary")).to_contain_text(f"reachable at {control}")

    strip = page.locator(f'.model-card[data-model="{MODEL}"] .strip')
    expect(strip.locator(".layer")).to_have_count(8)
    expect(strip.locator(".layer.gap")).to_have_count(0)
    assert strip.locator(".layer").all_text_contents() == ["1"] * 8  # one replica per layer
    expect(strip.locator(".span-bar")).to_have_count(3)  # a bar per hop

    # The peer's model name, as text wherever it appears, never as markup.
    expect(page.locator("#model option", has_text=XSS_NAME)).to_have_count(1)
    names = page.locator(".model-card .model-name").all_text_contents()
    assert XSS_NAME in names, names
    serves = page.locator(f'tr.member[data-node="{peer.node_id}"] td:nth-child(4)')
    expect(serves).to_contain_text(XSS_NAME)
    assert page.evaluate("document.querySelectorAll('img').length") == 0
    assert page.evaluate("typeof window.__xss") == "undefined"
    expect(page.locator("#offline")).to_be_hidden()  # every part of the view drew
    page.screenshot(path=ARTIFACTS / "swarm.png", full_page=True)


def check_chat(page: Any, entry: LocalNode, expected: str) -> None:
    from playwright.sync_api import expect

    page.select_option("#model", MODEL)
    page.click(".settings summary")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(ANSWER_TOKENS))
    page.fill("#prompt", PROMPT)
    page.press("#prompt", "Enter")
    answer = page.locator(".msg.assistant").last
    expect(answer).to_have_attribute("data-state", "done")
    assert answer.locator(".text").text_content() == expected
    assert int(answer.get_attribute("data-deltas") or 0) > 1  # streamed in pieces
    expect(answer.locator(".meta")).to_contain_text("via 3 nodes")
    page.screenshot(path=ARTIFACTS / "chat.png", full_page=True)

    # Stop: a long answer, stopped once it is flowing; the node sees the client go.
    page.fill("#max-tokens", "1500")
    page.fill("#prompt", "And tell me a very long story.")
    page.press("#prompt", "Enter")
    answer = page.locator(".msg.assistant").last
    expect(answer).to_have_attribute("data-state", "streaming")
    page.wait_for_function("el => Number(el.dataset.deltas || 0) >= 3", arg=answer.element_handle())
    page.click("#stop")
    expect(answer).to_have_attribute("data-state", "stopped")
    deadline = time.monotonic() + 10
    while httpx.get(entry.api + "/v1/network/status").json()["chat"]["requests"]["cancelled"] < 1:
        assert time.monotonic() < deadline, "the node never saw the stopped stream end"
        time.sleep(0.2)


def check_gap(page: Any, victim: LocalNode) -> None:
    from playwright.sync_api import expect

    victim.kill()  # SIGKILL: the hop serving layers [3, 6)
    gaps = page.locator(f'.model-card[data-model="{MODEL}"] .layer.gap')
    expect(gaps).to_have_count(3)
    assert [gaps.nth(i).get_attribute("data-layer") for i in range(3)] == ["3", "4", "5"]
    expect(page.locator(f'.model-card[data-model="{MODEL}"] .gap-text')).to_have_text(f"gap: {GAP}")
    row = page.locator(f'tr.member[data-node="{victim.node_id}"]')
    expect(row).to_have_class(re.compile(r"\bgone\b"))
    expect(row).to_have_attribute("data-state", "dead")
    page.screenshot(path=ARTIFACTS / "gap.png", full_page=True)


def check_loading_wait(page: Any, victim: LocalNode) -> None:
    from playwright.sync_api import expect

    page.fill("#max-tokens", str(ANSWER_TOKENS))
    page.fill("#prompt", "Are you still there?")
    page.press("#prompt", "Enter")
    wait = page.locator("#wait")
    expect(wait).to_be_visible()
    expect(wait).to_have_attribute("data-kind", "model_loading")
    expect(page.locator("#wait-details")).to_contain_text(f"gaps: {GAP}")
    expect(page.locator("#wait-strip .layer.gap")).to_have_count(3)
    page.screenshot(path=ARTIFACTS / "waiting.png", full_page=True)
    # Retried after the 503's Retry-After (5 s); meanwhile the dead member drops.
    expect(wait).to_have_attribute("data-attempt", "2", timeout=UI_TIMEOUT_MS)
    expect(page.locator(f'tr.member[data-node="{victim.node_id}"]')).to_have_count(0)
    expect(page.locator("#hidden-members")).to_contain_text("1 dead or left member")
    page.click("#stop")
    expect(page.locator(".msg.assistant").last).to_have_attribute("data-state", "stopped")
    expect(wait).to_be_hidden()
    expect(page.locator("#offline")).to_be_hidden()
    page.screenshot(path=ARTIFACTS / "dropped.png", full_page=True)
