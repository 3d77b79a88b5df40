"""Blame the liar, not its neighbours (issue 30, item 4), on real node processes.

Liars that lie between their commitment and the wire, planted with
tests/fault_hooks/lying_hop.py: a *transit liar* (a first hop that commits
its honest output and forwards noise), a *token-mismatch liar* (a last
hop that commits the token it sampled and emits the next one), and an
*equivocator* (a first hop that gives the next hop noise with a commitment
to match, and the entry its honest commitment; found after the answer, by
the receipt the next hop relays). Before this
item the first served wrong answers and was never quarantined, while the
entry distrusted it and every honest node of the model (they were the ones
whose inputs disagreed); the second was caught by spot checks with unsigned
evidence and never quarantined. Now each one's own receipt for what it sent
contradicts its commitment: the next hop (or the entry, for a token) sees it
before using anything, the generation goes on elsewhere, and the proof
quarantines the liar alone. The policy checks every finished request, as
the measured attack had it, so spot checks run beside the new checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from runtime.cli.localswarm import LocalNode, LocalSwarm, Views
from runtime.model.tiny import make_tiny_model
from tests.swarm_helpers import (
    ADMIT_TIMEOUT_S,
    START_TIMEOUT_S,
    fault_env,
    serving,
    verify_every_request,
    wait_for,
)

MODEL = "tiny"
MAX_TOKENS = 8
REQUEST_TIMEOUT_S = 30.0
MAX_REQUESTS = 20
"""The acceptance bound: quarantined within this many requests."""
MAX_WRONG = 2
"""The acceptance bound on wrong answers served while the liar was in."""
EQUIVOCATION_MAX_WRONG = 3
"""An equivocation is found after its answer, once the request's
commitments are in; the client's next request may already be on the liar
before the entry avoids it, so one more wrong answer than the bound."""
PROMPTS = 3
"""Distinct questions, asked in turn; their honest answers are learnt
before the liar joins (greedy sampling: one right answer each)."""
VERDICT_WAIT_S = 15.0


def _body(n: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Question {n % PROMPTS}: who answers?"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }


async def _ask(client: httpx.AsyncClient, entry: LocalNode, n: int) -> tuple[str, list[str]]:
    """One chat; its answer and route. Every request must be served."""
    response = await client.post(entry.api + "/v1/chat/completions", json=_body(n))
    assert response.status_code == 200, response.text
    reply = response.json()
    return reply["choices"][0]["message"]["content"], reply["shardmesh"]["route"]


def _quarantined(entry: LocalNode, node: LocalNode) -> Any:
    def check(views: Views) -> bool:
        return node.node_id in (views.get(entry.name) or {}).get("quarantined", [])

    return check


async def _swarm(
    swarm: LocalSwarm, tmp_path: Path, spans: list[str], liar_span: str, mode: str
) -> tuple[LocalNode, list[LocalNode], LocalNode]:
    """A serving-nothing entry (the founder: the leader that judges), an
    honest node per span in ``spans``, every request checked; the liar
    (``mode``, serving ``liar_span``) is created, not started."""
    model_dir = make_tiny_model(tmp_path / "models" / MODEL, layers=4, name=MODEL)
    entry = swarm.new_node("entry")
    honest = [
        swarm.new_node(f"honest{i}", args=["--model", str(model_dir), "--layers", span])
        for i, span in enumerate(spans)
    ]
    liar = swarm.new_node(
        "liar",
        args=["--model", str(model_dir), "--layers", liar_span],
        env=fault_env("lying_hop", mode),
    )
    await swarm.start_ready(entry, timeout=START_TIMEOUT_S)
    await swarm.start_many(honest, [entry.seed], timeout=START_TIMEOUT_S)
    await wait_for(swarm, [entry], serving(entry, MODEL, honest), ADMIT_TIMEOUT_S, "honest")
    await verify_every_request(entry)
    return entry, honest, liar


async def _caught(
    swarm: LocalSwarm, entry: LocalNode, honest: list[LocalNode], liar: LocalNode
) -> tuple[int, int]:
    """Learn the honest answers, let the liar in, and ask until it is
    quarantined: how many requests that took and how many answers were
    wrong. The honest nodes are never quarantined nor distrusted, and serve
    every request throughout."""
    honest_ids = {node.node_id for node in honest}
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        right = [(await _ask(client, entry, n))[0] for n in range(PROMPTS)]
        await swarm.start_ready(liar, [entry.seed], timeout=START_TIMEOUT_S)
        await wait_for(swarm, [entry], serving(entry, MODEL, [liar]), ADMIT_TIMEOUT_S, "liar")
        requests = wrong = 0
        carried = False
        while requests < MAX_REQUESTS:
            answer, route = await _ask(client, entry, requests)
            wrong += answer != right[requests % PROMPTS]
            requests += 1
            carried |= liar.node_id in route
            status = await swarm.status(entry)
            assert status is not None
            avoided = set(status["quarantined"]) | set(status["verify"]["checks"]["distrusted"])
            assert not honest_ids & avoided, status["verify"]  # throughout, not only at the end
            if liar.node_id in status["quarantined"]:
                break
        await wait_for(swarm, [entry], _quarantined(entry, liar), VERDICT_WAIT_S, "verdict")
        for n in range(PROMPTS):  # the liar carries nothing now, and all is right
            answer, route = await _ask(client, entry, n)
            assert liar.node_id not in route and answer == right[n]
    status = await swarm.status(entry)
    assert status is not None
    record = next(q for q in status["quarantine"] if q["node_id"] == liar.node_id)
    assert record["reason"] == "wrong_output" and record["evidence"], record
    assert not honest_ids & set(status["quarantined"]), status
    assert not honest_ids & set(status["verify"]["checks"]["distrusted"]), status["verify"]
    assert status["verify"]["checks"].get("contradiction", 0) >= 1, status["verify"]
    assert not status["verify"]["verdicts"].get("false_report"), status["verify"]
    print(f"quarantined after {requests} requests, {wrong} wrong answers (carried: {carried})")
    return requests, wrong


async def test_a_transit_liar_is_quarantined_and_its_neighbours_keep_serving(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    """The issue's measured attack: the liar serves the first half of the
    model beside one honest node; two honest nodes serve the second half,
    the ones its noise went to."""
    entry, honest, liar = await _swarm(swarm, tmp_path, ["0:2", "2:4", "2:4"], "0:2", "transit")
    requests, wrong = await _caught(swarm, entry, honest, liar)
    assert requests <= MAX_REQUESTS and wrong <= MAX_WRONG


async def test_a_last_hop_that_emits_another_token_than_it_signed_is_quarantined(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    entry, honest, liar = await _swarm(swarm, tmp_path, ["0:4"], "0:4", "mismatch")
    requests, wrong = await _caught(swarm, entry, honest, liar)
    assert requests <= MAX_REQUESTS and wrong <= MAX_WRONG


async def test_a_hop_that_tells_its_next_hop_another_story_is_quarantined(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    """The liar sends the next hop noise with a commitment that agrees with
    it, and the entry its honest commitment: the next hop takes the step (the
    rows match what it was told), so this one may cost a wrong answer; the
    receipt the next hop relays, against the entry's copy, convicts it."""
    entry, honest, liar = await _swarm(swarm, tmp_path, ["0:2", "2:4"], "0:2", "equivocate")
    requests, wrong = await _caught(swarm, entry, honest, liar)
    assert requests <= MAX_REQUESTS and wrong <= EQUIVOCATION_MAX_WRONG
