"""Placement in the node: demand in, the leader's decisions out, shards loaded.

`consensus.placement` decides (a pure function of the ledger, membership and
the models' sizes); this module feeds it and carries out what it decides.
Every node runs all three loops, and only the leader proposes: demand
(chat counts requests; they reach the leader as `RecordDemand`), placement
(the policy input built from the ledger replica and membership; the leader
proposes pins, failed admissions, assignments and releases), and serving
(a managed assignment is loaded from the store and admitted by the doctor).

Each loop in full, and where sizes come from: docs/design/node.md#the-placement-driver.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any, Final

import httpx
import trio

from consensus.commands import Assign, Command, RecordDemand
from consensus.ledger import ApplyResult
from consensus.placement import (
    WAIT_MESSAGES,
    Announced,
    Decision,
    GapSuggestion,
    ModelFacts,
    NodeView,
    PlacementHistory,
    PlacementInput,
    PlacementSettings,
    best_gap,
    decide,
    explain,
    node_view,
    upkeep,
)
from consensus.settings import policy_json
from mesh.identity import Signer, node_id_text
from mesh.member_table import LIVE_STATES, state_name
from runtime.model.backends.base import BackendError
from runtime.model.store import ModelStore, WeightSource, model_facts
from runtime.node.admission import Admission, ServeOptions, ShardSlot
from runtime.node.raft_driver import NotLeader, ProposalFailed, RaftDriver
from runtime.node.signed_http import sign_request
from runtime.node.swarm_view import SwarmView

log = logging.getLogger("shardmesh.placement")

PLACEMENT_INTERVAL_S: Final = 0.25
"""One policy round per quarter second: the demand-to-commit target is 1 s,
and a round on a 10,000-node snapshot costs ~25 ms of the leader's CPU."""
DEMAND_FLUSH_S: Final = 0.5
"""Served requests are batched this long into one `RecordDemand` per model;
unserved ones are sent at once."""
ASSIGNMENT_POLL_S: Final = 0.2
"""How often a node compares the ledger's assignment with what it serves."""
MANIFEST_RETRY_S: Final = 5.0
"""After a failed manifest fetch, wait this long before asking again."""
RECENT_DECISIONS: Final = 32
DROP_UNKNOWN_MODEL: Final = "unknown_model"
"""Demand the leader refused: no member can serve the model (`demand_refusal`)."""
AUTO_JOIN_POLL_S: Final = 0.5

_Served = tuple[str, tuple[int, int], str, int, str]
"""An assignment as the node follows it: model, layers, recipe, epoch, tier."""


class AlreadyAssigned(Exception):
    """A bootstrap assignment for a node that already holds one."""


class NodeQuarantined(Exception):
    """A bootstrap assignment for a node the ledger holds quarantined: the
    leader assigns a quarantined node nothing (`consensus.placement`)."""


class Placement:
    """The node's placement loops (see the module doc); `run` in its nursery."""

    def __init__(
        self,
        *,
        raft: RaftDriver,
        swarm: SwarmView,
        store: ModelStore,
        slot: ShardSlot,
        backend: str | None,
        auto_join: bool,
        signer: Signer,
        auto_join_recipe: str | None = None,
    ) -> None:
        """`slot` is where managed and bootstrap shards are served;
        `backend` is `--backend`, `auto_join` is `--auto-join`; `signer`
        (the node's identity) signs what this node posts to the leader;
        `auto_join_recipe` (`--recipe`) replaces the suggestion's recipe
        (the precision the model is stored in) for the auto-joined shard."""
        self.node_id = swarm.node_id
        self._signer = signer
        self._raft = raft
        self._swarm = swarm
        self._store = store
        self._slot = slot
        self._backend = backend
        self._wants_auto_join = auto_join
        self._auto_join_recipe = auto_join_recipe
        self.history = PlacementHistory()
        self.facts: dict[str, ModelFacts] = {}
        self.waiting: dict[str, str] = {}
        self.decisions: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=RECENT_DECISIONS
        )
        self._demand: Counter[str] = Counter()
        self.drops: Counter[str] = Counter()  # status: "placement.REASON"
        self._urgent = trio.Event()
        self._fetch_after: dict[str, float] = {}
        self._serving: _Served | None = None
        self._unstocked: _Served | None = None
        """An assignment of a model the store lacks, said once (`_follow_assignment`)."""
        self._serving_scope: trio.CancelScope | None = None
        self._snapshot_cache: PlacementInput | None = None
        raft.on_apply.append(self._observe)

    @property
    def policy(self) -> PlacementSettings:
        """The swarm's policy, as committed in the ledger (`shardmesh policy`):
        every node decides and explains with the same knobs, whoever leads."""
        return self._raft.ledger.policy()

    def _observe(self, result: ApplyResult) -> None:
        if result.accepted and result.command is not None:
            self.history.observe(result.command)

    # --- demand -------------------------------------------------------------------

    def count_demand(self, model: str, *, unserved: bool) -> None:
        """One chat request for `model` arrived here."""
        self._demand[model] += 1
        if unserved:
            self._urgent.set()

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._report_demand)
            nursery.start_soon(self._place)
            nursery.start_soon(self._follow_assignment, nursery)
            if self._wants_auto_join:
                nursery.start_soon(self._auto_join)

    async def _report_demand(self) -> None:
        while True:
            with trio.move_on_after(DEMAND_FLUSH_S):
                await self._urgent.wait()
            self._urgent = trio.Event()
            pending, self._demand = self._demand, Counter()
            for model, count in sorted(pending.items()):
                if not await self._send_demand(model, count):
                    self._demand[model] += count  # try again next flush

    def demand_refusal(self, model: str) -> str | None:
        """Why demand for `model` must not be proposed, or None when it may.

        Only demand for a model some member can serve enters the ledger
        (`SwarmView.known_models`): any other is invented, and committed it
        would sit in every replica's table. The leader asks before it
        proposes, here and in `POST /v1/network/demand` (followers relay to
        it: the leader's view decides); each refusal counts in `drops`."""
        if model in self._swarm.known_models():
            return None
        self.drops[DROP_UNKNOWN_MODEL] += 1
        return (
            f"no member stores or is assigned the model {model!r}; "
            "demand is recorded only for models the swarm can serve"
        )

    async def _send_demand(self, model: str, count: int) -> bool:
        if self._raft.is_leader and self.demand_refusal(model) is not None:
            return True  # refused (counted), not retried: nobody could ever place it
        command = RecordDemand(model=model, count=count, at=time.time())
        body = {"model": model, "count": count}
        return await self._propose_anywhere(command, "/v1/network/demand", body)

    async def _propose_anywhere(self, command: Command, path: str, body: dict[str, Any]) -> bool:
        """Propose `command` if we lead, else post `body` to the leader's
        `path` (the API endpoint that proposes the same command there),
        signed by this node: the leader checks who asks."""
        try:
            await self._raft.propose(command)
            return True
        except NotLeader as exc:
            leader = exc.leader
        except ProposalFailed:
            return False
        url = self._swarm.member_api(leader) if leader is not None else None
        if url is None:
            return False
        content = json.dumps(body).encode()
        headers = {
            "content-type": "application/json",
            **sign_request(self._signer, "POST", path, content, time.time()),
        }
        try:
            async with httpx.AsyncClient(timeout=5.0) as client:
                reply = await client.post(f"{url}{path}", content=content, headers=headers)
        except httpx.HTTPError:
            return False
        if reply.status_code in (401, 403):
            log.warning("the leader refused %s: %s", path, reply.text[:200])
        return reply.status_code == 200

    # --- bootstrap (ADR-0011 via ADR-0026) -----------------------------------------

    def suggest(self, memory_bytes: int, models: Iterable[str]) -> GapSuggestion | None:
        """`POST /v1/network/assign`: the best gap for a joining node."""
        if self._snapshot_cache is None:
            return None
        view = NodeView("alive", memory_bytes=memory_bytes, models=frozenset(models), spare=True)
        return best_gap(self._snapshot_cache, view, self.policy)

    def bootstrap_command(
        self, node: bytes, model: str, layers: tuple[int, int], recipe: str
    ) -> Assign:
        """The Assign that `POST /v1/nodes/assign` proposes: pinned once
        accepted (tier bootstrap). AlreadyAssigned if the node holds one,
        NodeQuarantined while the ledger holds it quarantined."""
        ledger, now = self._raft.ledger, time.time()
        benched = ledger.quarantined(now).get(node)
        if benched is not None:
            raise NodeQuarantined(
                f"node {node_id_text(node)[:12]} is quarantined ({benched.reason}) until "
                f"{benched.until}; it is assigned nothing until then"
            )
        held = ledger.assignment(node)
        if held is not None:
            raise AlreadyAssigned(
                f"node {node_id_text(node)[:12]} already holds {held.model} "
                f"[{held.layers[0]}, {held.layers[1]}) as {held.tier}; bootstrap assignment "
                "is for a node's first join"
            )
        return Assign(
            node=node,
            model=model,
            layers=layers,
            recipe=recipe,
            tier="bootstrap",
            managed=False,
            epoch=ledger.epoch(node) + 1,
            at=now,
        )

    async def _auto_join(self) -> None:
        """`--auto-join`: once a leader is known and this node's ledger is as
        new as the leader's notice, take the best gap for this node's memory
        and store, as a bootstrap assignment."""
        while True:
            await trio.sleep(AUTO_JOIN_POLL_S)
            if self._raft.ledger.assignment(self.node_id) is not None:
                return
            backend = self._slot.backend
            if backend is None or self._raft.leader() is None or not self._raft.caught_up():
                continue
            self._snapshot_cache = await self._snapshot()  # of the ledger caught up with
            gap = self.suggest(backend.memory_bytes, self._store.names())
            if gap is None:
                continue
            recipe = self._auto_join_recipe or gap.recipe
            try:
                command = self.bootstrap_command(self.node_id, gap.model, gap.layers, recipe)
            except NodeQuarantined:
                continue  # asked again once the quarantine ends
            body = {
                "node_id": node_id_text(self.node_id),
                "model": gap.model,
                "layers": list(gap.layers),
                "recipe": recipe,
            }
            if await self._propose_anywhere(command, "/v1/nodes/assign", body):
                log.info("auto-join: took %s [%d, %d)", gap.model, *gap.layers)
                return

    # --- placement ------------------------------------------------------------------

    async def _place(self) -> None:
        while True:
            await trio.sleep(PLACEMENT_INTERVAL_S)
            snapshot = await self._snapshot()
            self._snapshot_cache = snapshot
            self.waiting = explain(snapshot, self.policy)
            if not self._raft.is_leader:
                continue
            decisions = upkeep(self._raft.ledger, self._announced(), time.time())
            if not decisions:  # decide on a ledger that already knows the pinned shards
                decisions = decide(snapshot, self.policy)
            for decision in decisions:
                try:
                    committed = await self._raft.propose(decision.command)
                except (NotLeader, ProposalFailed) as exc:
                    log.info("placement round stopped: %s", exc)
                    break
                self._remember(decision, committed.index, committed.accepted)

    def _remember(self, decision: Decision, index: int, ok: bool) -> None:
        command, code, reason = decision.command, decision.code, decision.reason
        node = getattr(command, "node", None)
        entry = {
            "command": type(command).__name__,
            "node_id": node_id_text(node) if node else None,
            "model": getattr(command, "model", None),
            "layers": list(command.layers) if isinstance(command, Assign) else None,
            "code": code,
            "reason": reason,
            "index": index,
            "accepted": ok,
            "at": time.time(),
        }
        self.decisions.append(entry)
        log.info("placement: %s %s %s (%s)", entry["command"], entry["model"], code, reason)

    async def _snapshot(self) -> PlacementInput:
        ledger = self._raft.ledger
        now, mono = time.time(), trio.current_time()
        views = {}
        wanted: set[str] = set(ledger.demand()) | {a.model for a in ledger.assignments()}
        for member, record in self._swarm.records():
            since = now - (mono - member.state_since)
            views[member.node] = node_view(
                state_name(member.state), since, record, ledger.assignment(member.node), now
            )
            if record is not None:
                wanted.update(record.models)
        for name in sorted(wanted - self.facts.keys()):
            await self._learn_facts(name)
        return PlacementInput.from_ledger(
            ledger,
            nodes=views,
            models={n: f for n, f in self.facts.items() if n in wanted},
            now=now,
            has_quorum=self._raft.leader() is not None,
            history=self.history,
        )

    async def _learn_facts(self, name: str) -> None:
        """Sizes of `name` from our store, else from a member's manifest."""
        stored = self._store.get(name)
        if stored is not None:
            self.facts[name] = model_facts(stored.manifest)
            return
        if trio.current_time() < self._fetch_after.get(name, 0.0):
            return
        for _, record in self._swarm.records():
            if record is None or name not in record.models:
                continue
            url = record.addresses.api
            try:
                async with httpx.AsyncClient(timeout=5.0) as client:
                    reply = await client.get(f"{url}/v1/network/models/{name}/manifest")
                reply.raise_for_status()
                self.facts[name] = model_facts(reply.json())
                return
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                continue
        self._fetch_after[name] = trio.current_time() + MANIFEST_RETRY_S

    def _announced(self) -> dict[bytes, Announced]:
        """What each member's signed record says about its shard (`upkeep`)."""
        announced = {}
        for member, record in self._swarm.records():
            if record is None or record.assignment is None:
                continue
            failure = None
            if record.capability is not None and record.capability.result == "failed":
                failure = record.capability.failure or "failed"
            live = member.state in LIVE_STATES
            announced[member.node] = Announced(record.assignment, live, failure)
        return announced

    # --- serving what the ledger assigns us ----------------------------------------

    async def _follow_assignment(self, nursery: trio.Nursery) -> None:
        while True:
            await trio.sleep(ASSIGNMENT_POLL_S)
            mine = self._raft.ledger.assignment(self.node_id)
            wanted = None
            if mine is not None and mine.tier != "operator":  # managed or bootstrap
                wanted = (mine.model, mine.layers, mine.recipe, mine.epoch, mine.tier)
            if wanted == self._serving:
                continue
            if self._serving is not None:
                log.info("assignment %s ended; no longer serving it", self._serving)
                self._stop_serving()
            if wanted is None:
                continue
            stored = self._store.get(wanted[0])
            if stored is None:
                # The leader only assigns what our record says the store holds:
                # the store changed under us, or (`shardmesh serve` restarted
                # with its pinned span) the ledger came before the store was
                # stocked. Say it once, serve it once the model is in the store;
                # until then the assignment stays unadmitted (the policy's idle
                # rule releases a managed one).
                if wanted != self._unstocked:
                    log.warning("assigned %s, which is not in this node's store (yet)", wanted[0])
                    self._unstocked = wanted
                continue
            self._serving = wanted
            self._serving_scope = trio.CancelScope()
            admission = self._slot.start(
                ServeOptions(
                    model_dir=stored.path,
                    layers=wanted[1],
                    recipe=wanted[2],
                    backend=self._backend,
                ),
                tier=wanted[4],
                epoch=wanted[3],
            )
            nursery.start_soon(self._serve, admission, self._serving_scope, stored.source)

    @staticmethod
    async def _serve(
        admission: Admission, scope: trio.CancelScope, source: WeightSource | None
    ) -> None:
        """Fetch the span's weight files if the store has not got them all,
        then admit and serve. A failed fetch is logged; the doctor then
        refuses the span and its report names the missing tensor."""
        with scope:
            if source is not None:
                layers = admission.options.layers
                try:
                    await trio.to_thread.run_sync(
                        source.fetch_span, *layers, abandon_on_cancel=True
                    )
                except (BackendError, OSError) as exc:
                    log.error("cannot fetch the weights of layers %d:%d: %s", *layers, exc)
            await admission.run()

    def _stop_serving(self) -> None:
        if self._serving_scope is not None:
            self._serving_scope.cancel()
        self._serving = None
        self._serving_scope = None
        self._slot.clear()

    # --- views ----------------------------------------------------------------------

    def num_layers(self, model: str) -> int | None:
        """The model's layer count, once its manifest has been read: by a
        placement round, or now from this node's own store (a request can
        come before the first round that wanted the model)."""
        facts = self.facts.get(model)
        if facts is None and (stored := self._store.get(model)) is not None:
            facts = self.facts[model] = model_facts(stored.manifest)
        return None if facts is None else facts.num_layers

    def why_waiting(self, model: str) -> tuple[str, str]:
        """(code, text) for a 503 `model_loading` body. A model no round has
        planned yet is `no_demand` when its size is known (the request that
        asks is the demand), else `unknown_model`."""
        known = self.num_layers(model) is not None
        code = self.waiting.get(model, "no_demand" if known else "unknown_model")
        return code, WAIT_MESSAGES.get(code, code)

    def to_json(self) -> dict[str, Any]:
        now = time.time()
        cooldowns = {
            node_id_text(a.node): round(a.assigned_at + self.policy.cooldown_s - now, 1)
            for a in self._raft.ledger.assignments()
            if a.managed and now < a.assigned_at + self.policy.cooldown_s
        }
        return {
            "waiting": dict(sorted(self.waiting.items())),
            "decisions": list(self.decisions),
            "cooldown_s": cooldowns,  # managed nodes not yet retargetable, seconds left
            "policy": policy_json(self.policy),
            "models": {
                name: {
                    "num_layers": f.num_layers,
                    "layer_bytes": f.layer_bytes,
                    "recipe": f.recipe,
                }
                for name, f in sorted(self.facts.items())
            },
        }
