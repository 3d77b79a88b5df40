"""Spot checks: entries replay some finished requests on other nodes, and the leader judges.

`SpotChecker` (the entry): with the probability the swarm's policy sets, a
finished request is replayed as one prefill on a chain of other nodes
serving the same spans; the first disagreeing commitment names a suspect,
which the entry avoids for `DISTRUST_S`, and, once a second replay confirms
it and the commitment is signed, reports to the leader as `Evidence`.
`Adjudicator` (the leader): judges evidence by one more recomputation
avoiding both parties and commits a `Verdict`, which quarantines the guilty
or counts a false report against the reporter.

The rules in full (independence, confirmation, unchecked spans):
docs/design/verified-compute.md#spot-checks-and-verdicts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import httpx
import trio

from consensus.commands import Verdict
from mesh.coverage import CoverageMap, ModelCoverage
from mesh.identity import Signer, node_id_text
from runtime.inference.blame import Contradiction, find_equivocation, receipted
from runtime.inference.chain import ChainHop, Pipeline, PipelineError, replay
from runtime.inference.commitment import SIGN_EVERY, Commitment
from runtime.inference.swarm import SwarmReader
from runtime.inference.transcript import (
    Divergence,
    Replay,
    Transcript,
    find_divergence,
    judge_step,
)
from runtime.model.recipes import get_recipe
from runtime.model.sampling import SEED_MODULUS, SamplingParams
from runtime.node.signed_http import sign_request

log = logging.getLogger("shardmesh.verify")

__all__ = [
    "DISTRUST_S",
    "EVIDENCE_PATH",
    "MAX_EVIDENCE_BYTES",
    "Adjudicator",
    "Evidence",
    "SpotChecker",
    "send_evidence",
    "tolerance",
]

EVIDENCE_PATH: Final = "/v1/network/evidence"
EVIDENCE_POST_TIMEOUT_S: Final = 10.0
MAX_EVIDENCE_BYTES: Final = 2 * 1024 * 1024
"""Evidence is the request (at most MAX_CHECKED_POSITIONS ids) and one
commitment (a prefill's sketches: 64 bytes a position, base64 in JSON):
well under this for the longest request a check replays."""

TOLERANCE_FACTOR: Final = 2.0
"""A recipe's tolerance bounds one shard's error against the fp32 truth; two
honest replicas may each be off by that much in opposite directions, so
they may differ from each other by twice it."""

DISTRUST_S: Final = 600.0
"""How long an entry avoids a node one of its checks caught, on its own
authority: long enough for the leader to judge the evidence and commit a
quarantine (seconds), or for a node it could not report (no independent
replica, no signature) to stop carrying this entry's traffic for a while."""

MAX_PENDING_CHECKS: Final = 4
"""Finished requests waiting for their replay. A replay costs one prefill of
the request's history on the checking chain; a burst of requests beyond
this is not checked (counted as ``busy``) rather than queued without bound."""

MAX_CHECKED_POSITIONS: Final = 4096
"""Longest history a check replays (prompt plus tokens): one prefill, within
every hop's session budget. Longer generations go unchecked (counted)."""

MAX_PENDING_VERDICTS: Final = 8
"""Evidence waiting for the leader's recomputation; more is refused (429)
so a flood of reports cannot make the leader recompute without bound."""

MAX_PENDING_SCANS: Final = 16
"""Finished requests waiting for their equivocation scan (every one is
scanned: a few digest comparisons once its commitments are in); a burst
beyond this goes unscanned (counted as ``scan_busy``)."""

COMMITMENTS_WAIT_S: Final = 2.0
"""How long a check waits for commitments still on their way (a middle
hop sends its last one after the last token) before judging."""


def tolerance(recipes: Iterable[str]) -> float:
    """How far two honest computations in these recipes may differ."""
    return TOLERANCE_FACTOR * max(get_recipe(recipe).tolerance for recipe in recipes)


@dataclass(frozen=True, slots=True)
class Evidence:
    """What a reporter sends the leader: the request, the chain's spans,
    and the accused's signed commitment to the step that disagreed."""

    reporter: bytes
    kind: str
    hop_index: int
    model: str
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    sampling: SamplingParams
    seed: int
    layers: tuple[tuple[int, int], ...]
    commitment: Commitment
    links: tuple[Commitment, ...] = ()
    """The accused's commitments after ``commitment`` up to a signed one,
    when ``commitment`` itself is an unsigned link of its hash chain."""
    receipt: bytes = b""
    """The accused's receipt signature for the token it emitted at this
    step (a last hop's commitment): it proves ``commitment`` as ``links``
    would (`runtime.inference.blame.receipted`)."""
    proof: Contradiction | None = None
    """For kind ``contradiction``: the accused's receipt for what it sent,
    which ``commitment`` contradicts (runtime.inference.blame). It needs no
    recomputation: the accused's own signature convicts it."""

    @property
    def accused(self) -> bytes:
        return self.commitment.hop

    def to_json(self) -> dict[str, Any]:
        params = self.sampling
        return {
            "reporter": self.reporter.hex(),
            "kind": self.kind,
            "hop_index": self.hop_index,
            "model": self.model,
            "prompt": list(self.prompt),
            "tokens": list(self.tokens),
            "sampling": {
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k,
            },
            "seed": self.seed,
            "layers": [list(span) for span in self.layers],
            "commitment": self.commitment.to_json(),
            "links": [link.to_json() for link in self.links],
            "receipt": self.receipt.hex(),
            "proof": None if self.proof is None else self.proof.to_json(),
        }

    def digest(self) -> bytes:
        """What the ledger records the verdict by: the same evidence is
        judged once."""
        canonical = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).digest()

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Evidence:
        """ValueError for anything malformed or inconsistent (it came from
        another node): the commitment must be the reporter's, for the
        accused's place in the chain, and signed by the accused."""
        try:
            sampling = value["sampling"]
            evidence = cls(
                reporter=bytes.fromhex(value["reporter"]),
                kind=str(value["kind"]),
                hop_index=int(value["hop_index"]),
                model=str(value["model"]),
                prompt=tuple(int(t) for t in value["prompt"]),
                tokens=tuple(int(t) for t in value["tokens"]),
                sampling=SamplingParams(
                    temperature=sampling["temperature"],
                    top_p=sampling["top_p"],
                    top_k=sampling["top_k"],
                ),
                seed=int(value["seed"]) % SEED_MODULUS,
                layers=tuple((int(a), int(b)) for a, b in value["layers"]),
                commitment=Commitment.from_json(value["commitment"]),
                links=tuple(Commitment.from_json(link) for link in value["links"][:SIGN_EVERY]),
                receipt=bytes.fromhex(value.get("receipt", "")),
                proof=_proof(value.get("proof")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed evidence: {exc}") from None
        problem = evidence._problem()
        if problem:
            raise ValueError(f"inconsistent evidence: {problem}")
        return evidence

    def _problem(self) -> str:
        """Why this is no evidence ("" when it is)."""
        c = self.commitment
        if self.kind == "contradiction":
            return self._contradiction_problem()
        if self.proof is not None:
            return "only a contradiction carries a proof"
        if self.kind not in ("output", "token", "input"):
            return f"kind {self.kind!r} is not one a recomputation can judge"
        if not 0 <= self.hop_index < len(self.layers):
            return "hop_index is outside the chain"
        if c.layers != self.layers[self.hop_index] or c.model != self.model:
            return "the commitment is for another shard"
        if c.entry != self.reporter:
            return "the commitment was made for another entry"
        if c.pos + c.count > len(self.prompt) + len(self.tokens):
            return "the commitment covers positions past the request"
        if len(self.prompt) + len(self.tokens) > MAX_CHECKED_POSITIONS or not self.tokens:
            return "the request is empty or too long to recompute"
        if not (c.verified_through(self.links) or receipted(c, self.receipt)):
            return "the commitment's signature does not verify (nor its chain's)"
        return ""

    def _contradiction_problem(self) -> str:
        """A contradiction is judged by its own signatures: the receipt the
        accused signed for what it sent, against its commitment."""
        c, proof = self.commitment, self.proof
        if proof is None or proof.commitment.digest() != c.digest():
            return "a contradiction needs the accused's receipt for this commitment"
        if not 0 <= self.hop_index < len(self.layers) or c.layers != self.layers[self.hop_index]:
            return "the commitment is for another shard"
        if c.model != self.model or c.entry != self.reporter:
            return "the commitment was made for another model or entry"
        try:
            proof.fault()
        except ValueError as exc:
            return f"no contradiction: {exc}"
        return ""

    def transcript(self, chain: Sequence[ChainHop]) -> Transcript:
        """The request as a transcript over ``chain`` holding only the
        accused's commitment, to judge it with."""
        step = self.commitment.step
        transcript = Transcript(self.model, self.prompt, self.sampling, self.seed)
        transcript.chain_nodes = [hop.node for hop in chain]
        transcript.chain_layers = [hop.layers for hop in chain]
        transcript.tokens = list(self.tokens)
        transcript.add(self.hop_index, self.commitment)
        assert (self.hop_index, step) in transcript.commitments
        return transcript


def _proof(value: object) -> Contradiction | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError("proof must be an object")
    return Contradiction.from_json(value)


@dataclass(frozen=True, slots=True)
class _Checking:
    """A replay chain and, per hop, whether it is another node than the one
    it checks (only then is a disagreement independent evidence)."""

    chain: list[ChainHop]
    independent: list[bool]
    recipes: list[str]


@dataclass(frozen=True, slots=True)
class _Confirmed:
    """Who a second replay showed lied, and its signed commitment:
    ``by_replay`` when it was the first replay's own hop (its output, which
    it signed to this entry), else the checked generation's hop."""

    accused: bytes
    commitment: Commitment
    by_replay: bool


def _variant(coverage: CoverageMap, model: str, nodes: Sequence[bytes]) -> ModelCoverage | None:
    """The coverage variant the checked chain ran in (recipe classes do not
    mix), or None when its nodes are no longer all served."""
    for variant in coverage.for_model(model):
        serving = {n.node_id for n in variant.nodes}
        if all(node in serving for node in nodes):
            return variant
    return None


def _checking_chain(
    swarm: SwarmReader,
    variant: ModelCoverage,
    layers: Sequence[tuple[int, int]],
    avoid_per_span: Sequence[frozenset[bytes]],
    avoid: frozenset[bytes],
) -> _Checking | None:
    """A chain over ``layers`` with, per span, a random serving node not in
    that span's avoid set (falling back to the span's own node, marked not
    independent); None when a span has no usable node at all."""
    chain, independent, recipes = [], [], []
    for span, own in zip(layers, avoid_per_span, strict=True):
        candidates = [n for n in variant.nodes if n.layers == span and n.node_id not in avoid]
        others = [n for n in candidates if n.node_id not in own]
        pool = others or [n for n in candidates if n.node_id in own]
        if not pool:
            return None
        chosen = pool[secrets.randbelow(len(pool))]
        addresses = swarm.dial_addresses(chosen.node_id)
        if addresses is None:
            return None
        chain.append(ChainHop(node_id_text(chosen.node_id), addresses.data, span))
        independent.append(bool(others))
        recipes.append(chosen.recipe)
    return _Checking(chain, independent, recipes)


class SpotChecker:
    """The entry's side: pick finished requests, replay them, act on what
    disagrees (see the module docstring). Start :meth:`run` in a nursery."""

    def __init__(
        self,
        *,
        swarm: SwarmReader,
        pipeline: Pipeline,
        fraction: Callable[[], float],
        report: Callable[[Evidence], Awaitable[bool]],
        random: Callable[[], float] | None = None,
    ) -> None:
        """``fraction`` reads the policy's ``verify_fraction``; ``report``
        delivers evidence to the leader (True once it took it)."""
        self._swarm = swarm
        self._pipeline = pipeline
        self._fraction = fraction
        self._report = report
        self._random = random or (lambda: secrets.randbelow(2**53) / 2**53)
        self.counters: Counter[str] = Counter()
        self._distrusted: dict[bytes, float] = {}
        self._why: dict[bytes, str] = {}  # node -> what its latest distrust is for
        self._held: dict[bytes, Evidence] = {}  # signed evidence not sent (unconfirmed)
        self._reported: dict[bytes, float] = {}  # node -> until when not reported again
        self._send, self._receive = trio.open_memory_channel[Transcript](MAX_PENDING_CHECKS)
        self._proofs, self._proofs_out = trio.open_memory_channel[Evidence](MAX_PENDING_CHECKS)
        self._scans, self._scans_out = trio.open_memory_channel[Transcript](MAX_PENDING_SCANS)

    def accuse(self, transcript: Transcript, proof: Contradiction) -> None:
        """A generation's hop signed two accounts of one step that cannot
        both be true (found while it ran, before anything it sent was
        used): avoid it at once, and send the leader the evidence, which
        needs no replay. The proof was checked where it was found."""
        accused = proof.accused
        self.counters["contradiction"] += 1
        self._distrust(accused, why="signed a receipt its commitment contradicts")
        if accused not in transcript.chain_nodes:
            return
        hop_index = transcript.chain_nodes.index(accused)
        evidence = self._evidence(
            transcript, hop_index, "contradiction", proof.commitment, proof=proof
        )
        try:
            self._proofs.send_nowait(evidence)
        except trio.WouldBlock:
            self.counters["busy"] += 1

    def distrusted(self, now: float) -> frozenset[bytes]:
        """Nodes this entry's checks caught, still avoided at ``now``."""
        for node in [n for n, until in self._distrusted.items() if until <= now]:
            del self._distrusted[node]
            self._why.pop(node, None)
            self._held.pop(node, None)
        return frozenset(self._distrusted)

    def stats_json(self) -> dict[str, Any]:
        return {
            **self.counters,
            "distrusted": sorted(node_id_text(n) for n in self.distrusted(trio.current_time())),
        }

    def consider(self, transcript: Transcript) -> None:
        """A generation finished: check it with the policy's probability."""
        if not transcript.tokens or not transcript.chain_nodes:
            return
        try:
            self._scans.send_nowait(transcript)
        except trio.WouldBlock:
            self.counters["scan_busy"] += 1
        if self._random() >= self._fraction():
            self.counters["skipped"] += 1
            return
        if len(transcript.prompt) + len(transcript.tokens) > MAX_CHECKED_POSITIONS:
            self.counters["too_long"] += 1
            return
        try:
            self._send.send_nowait(transcript)
        except trio.WouldBlock:
            self.counters["busy"] += 1

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._file_proofs)
            nursery.start_soon(self._scan_all)
            async for transcript in self._receive:
                await self.check(transcript)
            nursery.cancel_scope.cancel()

    async def _scan_all(self) -> None:
        """Scan every finished generation, once its commitments are in, for
        a hop that sent the next hop another commitment than the entry
        (`runtime.inference.blame.find_equivocation`): proof, no replay."""
        async for transcript in self._scans_out:
            with trio.move_on_after(COMMITMENTS_WAIT_S):
                while not transcript.complete():
                    await trio.sleep(0.02)
            proof = find_equivocation(transcript)
            if proof is not None:
                self.counters["equivocation"] += 1
                self.accuse(transcript, proof)

    async def _file_proofs(self) -> None:
        """Report each contradiction once per episode, as checks do."""
        async for evidence in self._proofs_out:
            await self._file(evidence)

    async def check(self, transcript: Transcript) -> None:
        """Replay one finished generation and act on the first divergence.

        A divergence names the original hop only if a second replay, on
        other nodes again, confirms it: the first replay's own hop may be
        the liar, and an entry that reported on one replay would make every
        liar an accuser of the honest hops it happens to check."""
        with trio.move_on_after(COMMITMENTS_WAIT_S):
            while not transcript.complete():
                await trio.sleep(0.02)
        nodes = transcript.chain_nodes
        variant = _variant(self._swarm.coverage(), transcript.model, nodes)
        own = [frozenset({node}) for node in nodes]
        first = await self._replay(transcript, variant, own)
        if first is None:
            return
        found, checking, replayed = first
        self.counters["checked"] += 1
        if found is None:
            self.counters["clean"] += 1
            return
        self.counters[f"divergence.{found.kind}"] += 1
        index = found.hop_index
        log.warning(
            "spot check: %s at hop %d (%s), step %d: %s",
            found.kind,
            index,
            node_id_text(nodes[index])[:12],
            found.step,
            found.detail,
        )
        if found.kind == "transit" and self._equivocated(transcript, nodes[index - 1]):
            return  # the sender lied to the next hop, and signed it: blamed alone
        if found.kind in ("transit", "missing") or found.commitment is None:
            pair = [nodes[index - 1]] if found.kind == "transit" else []
            self._distrust(nodes[index], *pair, why=f"{found.kind} at step {found.step}")
            return  # nothing a recomputation can judge: avoided here only
        confirmed = await self._confirm(transcript, variant, own, found, checking, replayed)
        if confirmed is not None:
            await self._report_once(transcript, found, confirmed)

    def _equivocated(self, transcript: Transcript, sender: bytes) -> bool:
        """A transit divergence whose sender gave the next hop another
        commitment than this entry (the receipt the next hop relayed): the
        sender alone is to blame, with proof (`accuse`, as the scan of every
        generation does; a second accusation is not reported twice)."""
        proof = find_equivocation(transcript)
        if proof is None or proof.accused != sender:
            return False
        self.accuse(transcript, proof)
        return True

    async def _confirm(
        self,
        transcript: Transcript,
        variant: ModelCoverage | None,
        own: Sequence[frozenset[bytes]],
        found: Divergence,
        checking: _Checking,
        replayed: Replay,
    ) -> _Confirmed | None:
        """A second replay, avoiding the first replay's nodes too: who lied,
        if it agrees with one of the two (the original hop, or the first
        replay's own hop); None (the hop distrusted here, counted) when it
        cannot say, or what it confirms is no signed evidence."""
        index = found.hop_index
        accused = transcript.chain_nodes[index]
        second = None
        if checking.independent[index]:
            avoid = [span | {hop.node} for span, hop in zip(own, checking.chain, strict=True)]
            second = await self._replay(transcript, variant, avoid)
        if second is None or not second[1].independent[index]:
            self.counters["unconfirmed"] += 1
            self._hold(transcript, found)
            return None
        again = second[0]
        if again is None:  # the first replay's hop is the odd one out: it lied to us
            self.counters["replay_disagreed"] += 1
            liar = checking.chain[index].node
            if found.kind != "output":  # its signed rows may agree: only its word differed
                self._distrust(liar, why="its replay disagreed with two others")
                return None
            return _Confirmed(liar, replayed.commitments[index], by_replay=True)
        if (again.kind, again.hop_index) != (found.kind, index):
            self.counters["unconfirmed"] += 1
            self._hold(transcript, found)
            return None
        assert found.commitment is not None  # `check` acts only on a committed divergence
        return _Confirmed(accused, found.commitment, by_replay=False)

    async def _report_once(
        self, transcript: Transcript, found: Divergence, confirmed: _Confirmed
    ) -> None:
        """Avoid the liar, and send the leader the evidence, once per
        episode: not one offence per request it lied in before the verdict."""
        accused, commitment = confirmed.accused, confirmed.commitment
        now = trio.current_time()
        if self._reported.get(accused, now) > now:
            self.counters["already_reported"] += 1
            return
        self._distrust(accused)
        links = () if confirmed.by_replay else transcript.links(found.hop_index, found.step)
        if confirmed.by_replay:  # the replay hop's own commitment, proven by itself
            evidence = self._evidence(transcript, found.hop_index, "output", commitment)
        else:
            receipt = transcript.receipts.get((found.hop_index, found.step), b"")
            evidence = self._evidence(
                transcript, found.hop_index, found.kind, commitment, links=links, receipt=receipt
            )
        problem = evidence._problem()
        if problem:
            self.counters["unsigned" if "signature" in problem else "not_evidence"] += 1
            self._why[accused] = f"unsigned {found.kind} divergence at step {found.step}"
            return
        await self._file(evidence)

    def _evidence(
        self,
        transcript: Transcript,
        hop_index: int,
        kind: str,
        commitment: Commitment,
        *,
        links: tuple[Commitment, ...] = (),
        receipt: bytes = b"",
        proof: Contradiction | None = None,
    ) -> Evidence:
        """This entry's evidence against the hop at `hop_index` of
        `transcript`'s chain, with what proves `commitment` or the fault
        (links and receipt, or a contradiction's proof)."""
        return Evidence(
            reporter=self._swarm.node_id,
            kind=kind,
            hop_index=hop_index,
            model=transcript.model,
            prompt=transcript.prompt,
            tokens=tuple(transcript.tokens),
            sampling=transcript.sampling,
            seed=transcript.seed,
            layers=tuple(transcript.chain_layers),
            commitment=commitment,
            links=links,
            receipt=receipt,
            proof=proof,
        )

    def _hold(self, transcript: Transcript, found: Divergence) -> None:
        """A divergence no second replay confirmed: the hop is avoided here,
        and its signed commitment kept, to file should the entry run out of
        other holders of its span (`blocked`): the leader's recomputation
        then decides, rather than this entry's one replay."""
        accused = transcript.chain_nodes[found.hop_index]
        self._distrust(accused, why=f"unconfirmed {found.kind} divergence at step {found.step}")
        commitment = found.commitment
        if commitment is None:
            return
        links = transcript.links(found.hop_index, found.step)
        receipt = transcript.receipts.get((found.hop_index, found.step), b"")
        evidence = self._evidence(
            transcript, found.hop_index, found.kind, commitment, links=links, receipt=receipt
        )
        if not evidence._problem():
            self._held[accused] = evidence

    def blocked(self, nodes: Sequence[bytes]) -> str:
        """Every holder of a span, ``nodes``, is distrusted here: rather than
        go silent for `DISTRUST_S`, ask for verdicts. Signed evidence this
        entry held back is filed with the leader (its recomputation, not one
        replay here, decides); a node with evidence at the leader stays
        avoided until the verdict; a node with no signed evidence against it
        (a `transit` or `missing` divergence names two nodes or none) is
        avoided no longer: nothing could ever clear it. Says what it did,
        node by node, for the error the client gets."""
        said = []
        for node in nodes:
            why = self._why.get(node, "caught by a spot check")
            held = self._held.pop(node, None)
            if held is not None:
                try:
                    self._proofs.send_nowait(held)
                    why += ": evidence filed with the leader, awaiting its verdict"
                except trio.WouldBlock:
                    self._held[node] = held
                    why += ": evidence waiting to be filed"
            elif self._reported.get(node, 0.0) > trio.current_time():
                why += ": evidence with the leader, awaiting its verdict"
            else:
                self._distrusted.pop(node, None)
                why += ": no signed evidence, so no longer avoided"
            self.counters["blocked_span"] += 1
            said.append(f"{node_id_text(node)[:12]} ({why})")
        return "; ".join(said)

    async def _file(self, evidence: Evidence) -> None:
        """Send the leader ``evidence`` unless this episode of its accused
        was reported already; the accused is avoided meanwhile."""
        accused, now = evidence.accused, trio.current_time()
        if self._reported.get(accused, now) > now:
            self.counters["already_reported"] += 1
            return
        self._distrust(accused, why=f"{evidence.kind} evidence")
        reported = await self._report(evidence)
        self.counters["reported" if reported else "report_failed"] += 1
        if reported:
            self._reported = {n: u for n, u in self._reported.items() if u > now}
            self._reported[accused] = now + DISTRUST_S

    def _distrust(self, *nodes: bytes, why: str = "") -> None:
        until = trio.current_time() + DISTRUST_S
        for node in nodes:
            self._distrusted[node] = until
            if why:
                self._why[node] = why

    async def _replay(
        self,
        transcript: Transcript,
        variant: ModelCoverage | None,
        avoid: Sequence[frozenset[bytes]],
    ) -> tuple[Divergence | None, _Checking, Replay] | None:
        """One replay on a chain avoiding ``avoid`` per span, judged; None
        (counted) when no chain exists or the replay fails."""
        checking = None
        if variant is not None:
            layers = transcript.chain_layers
            checking = _checking_chain(self._swarm, variant, layers, avoid, frozenset())
        if checking is None or variant is None:
            self.counters["no_checking_chain"] += 1
            return None
        if not any(checking.independent):
            # Only the same nodes again: a replay would cost them a prefill
            # and prove nothing a third party could check.
            self.counters["unchecked"] += 1
            return None
        seeds = transcript.sketch_seeds
        result = await _replay(
            self._pipeline, checking.chain, transcript, seeds, self.counters, self.accuse
        )
        if result is None:
            return None
        recipes = [*checking.recipes, *_recipes(variant, transcript.chain_nodes)]
        return find_divergence(transcript, result, tolerance(recipes)), checking, result


Accuse = Callable[[Transcript, Contradiction], None]


async def _replay(
    pipeline: Pipeline,
    chain: list[ChainHop],
    transcript: Transcript,
    seeds: Sequence[int],
    counters: Counter[str],
    accuse: Accuse | None = None,
) -> Replay | None:
    """:func:`runtime.inference.chain.replay`, or None (counted) when it
    proves nothing about ``transcript``: the checking chain failed
    (``replay_failed``), or one of its own hops lied to the next with a
    signed account that contradicts what it told this entry
    (``replay_contradiction``). Judging by a replay a liar fed would blame
    the checked generation's honest hops; its proof goes to ``accuse``,
    against the replay's own chain, instead."""
    try:
        result = await replay(pipeline, chain, transcript, sketch_seeds=seeds)
    except PipelineError as exc:
        counters["replay_failed"] += 1
        log.info("replay for a check failed: %s", exc)
        if exc.failure.proof is not None and exc.collected is not None and accuse is not None:
            accuse(exc.collected, exc.failure.proof)
        return None
    proof = None if result.collected is None else find_equivocation(result.collected)
    if proof is None:
        return result
    counters["replay_contradiction"] += 1
    if accuse is not None and result.collected is not None:
        accuse(result.collected, proof)
    return None


def _recipes(variant: ModelCoverage, nodes: Sequence[bytes]) -> list[str]:
    by_node = {n.node_id: n.recipe for n in variant.nodes}
    return [by_node[node] for node in nodes if node in by_node]


Propose = Callable[[Verdict], Awaitable[bool]]


class Adjudicator:
    """The leader's side: judge evidence by one more recomputation and
    commit the verdict. Start :meth:`run` in a nursery; :meth:`submit`
    queues evidence (the API calls it for reports that reach the leader)."""

    def __init__(self, *, swarm: SwarmReader, pipeline: Pipeline, propose: Propose) -> None:
        self._swarm = swarm
        self._pipeline = pipeline
        self._propose = propose
        self.counters: Counter[str] = Counter()
        self._send, self._receive = trio.open_memory_channel[Evidence](MAX_PENDING_VERDICTS)

    def submit(self, evidence: Evidence) -> bool:
        """Queue ``evidence``; False when the queue is full (try later)."""
        try:
            self._send.send_nowait(evidence)
        except trio.WouldBlock:
            self.counters["busy"] += 1
            return False
        return True

    async def run(self) -> None:
        async for evidence in self._receive:
            await self.judge(evidence)

    async def judge(self, evidence: Evidence) -> bool | None:
        """Recompute and commit a verdict: True guilty, False a false
        report, None when no verdict could be reached. Where the swarm has
        a second independent node for the accused's span, both must agree:
        one recomputation on a liar would otherwise convict the honest or
        acquit a liar."""
        if evidence.kind == "contradiction":
            return await self._convict(evidence)
        coverage = self._swarm.coverage()
        variant = _variant(coverage, evidence.model, [evidence.accused]) or coverage.best(
            evidence.model
        )
        parties = frozenset({evidence.accused, evidence.reporter})
        first = await self._recompute(evidence, variant, parties)
        if first is None:
            return None
        guilty, judge = first
        second = await self._recompute(evidence, variant, parties | {judge})
        if second is not None and second[0] != guilty:
            self.counters["undecided"] += 1
            log.warning("no verdict on %s: recomputations disagree", node_id_text(evidence.accused))
            return None
        return await self._commit(evidence, guilty)

    async def _convict(self, evidence: Evidence) -> bool | None:
        """A contradiction convicts by the accused's own signatures, with no
        recomputation; one that does not hold is refused (None, counted)."""
        problem = evidence._problem()
        if problem:
            self.counters["refused"] += 1
            log.warning("contradiction refused: %s", problem)
            return None
        return await self._commit(evidence, True)

    async def _commit(self, evidence: Evidence, guilty: bool) -> bool:
        """Commit the verdict on ``evidence``; return ``guilty``."""
        verdict = Verdict(
            accused=evidence.accused,
            reporter=evidence.reporter,
            evidence=evidence.digest(),
            guilty=guilty,
            at=time.time(),
        )
        committed = await self._propose(verdict)
        outcome = "guilty" if guilty else "false_report"
        self.counters[outcome if committed else "not_committed"] += 1
        log.warning(
            "verdict on %s reported by %s: %s",
            node_id_text(evidence.accused)[:12],
            node_id_text(evidence.reporter)[:12],
            outcome,
        )
        return guilty

    async def _recompute(
        self, evidence: Evidence, variant: ModelCoverage | None, avoid: frozenset[bytes]
    ) -> tuple[bool, bytes] | None:
        """Whether one recomputation, with a node outside ``avoid`` on the
        accused's span, convicts; and that node. None (counted) when no
        such node serves the span or the recomputation fails."""
        checking = None
        if variant is not None:
            spans = [avoid] * len(evidence.layers)
            never = frozenset({evidence.accused})
            found = _checking_chain(self._swarm, variant, evidence.layers, spans, never)
            if found is not None and found.independent[evidence.hop_index]:
                checking = found
        if checking is None or variant is None:
            self.counters["no_independent_chain"] += 1
            return None
        seeds = [secrets.randbelow(SEED_MODULUS) for _ in checking.chain]
        seeds[evidence.hop_index] = evidence.commitment.sketch_seed
        transcript = evidence.transcript(checking.chain)
        result = await _replay(self._pipeline, checking.chain, transcript, seeds, self.counters)
        if result is None:
            return None
        accused_recipe = _recipes(variant, [evidence.accused]) or checking.recipes
        limit = tolerance([*checking.recipes, *accused_recipe])
        step = evidence.commitment.step
        divergence = judge_step(transcript, result, evidence.hop_index, step, limit)
        guilty = divergence is not None and divergence.kind in ("output", "token", "input")
        return guilty, checking.chain[evidence.hop_index].node


async def send_evidence(url: str, evidence: Evidence, signer: Signer) -> bool:
    """Post ``evidence`` to the leader whose API is at ``url``, signed by
    this node (the reporter); True once the leader queued it."""
    content = json.dumps(evidence.to_json()).encode()
    headers = {
        "content-type": "application/json",
        **sign_request(signer, "POST", EVIDENCE_PATH, content, time.time()),
    }
    try:
        async with httpx.AsyncClient(timeout=EVIDENCE_POST_TIMEOUT_S) as client:
            reply = await client.post(url + EVIDENCE_PATH, content=content, headers=headers)
    except httpx.HTTPError as exc:
        log.warning("evidence not delivered to the leader: %s", exc)
        return False
    if reply.status_code != 202:
        log.warning("the leader refused evidence (%d): %s", reply.status_code, reply.text[:200])
    return reply.status_code == 202
