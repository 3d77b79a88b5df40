"""Blame: who is at fault, from signed records alone (runtime.inference.blame), and on real shards.

The sans-IO part: a hop's receipt for what it sent, checked by the receiver
against the sender's commitment, points at the sender alone when the two
disagree, and the proof holds for anyone (JSON, the leader's evidence) while
a forged or altered one does not. The engine part, in one process over real
planes and torch shards: a middle hop that commits its honest output and
forwards noise, and a last hop that emits another token than it signed,
each stop the stream before anything of the lie is used, and the failure
names that hop alone, with the proof.
"""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import trio

from mesh.identity import Identity
from runtime.inference.blame import (
    Contradiction,
    Receipt,
    check_emitted,
    check_handoff,
    find_equivocation,
    receipted,
    row_digests,
    rows_digest,
    token_digest,
)
from runtime.inference.chain import PipelineError
from runtime.inference.commitment import Commitment, sketch
from runtime.inference.hop_server import HopServer, _handoff_header
from runtime.inference.protocol import encode_message
from runtime.inference.transcript import Transcript
from runtime.model.backends.base import ShardBackend
from runtime.model.sampling import SamplingParams
from runtime.node.spot_check import Evidence
from tests.runtime.inference.test_engine import (
    FAST,
    GREEDY,
    MODEL,
    PROMPT,
    SEED,
    SPANS,
    start_node,
    torch_shards,
)

__all__ = ["torch_shards"]  # the engine test's fixture: real torch shards

SEED_OF_HOP = 1234
WIDTH = 64


def _commitment(
    hop: Identity, entry: bytes, rows: np.ndarray, token: int | None = None
) -> Commitment:
    """A hop's commitment to a step whose output is ``rows`` (the last hop:
    one row of logits and ``token``)."""
    outputs = sketch(rows[-1:] if token is not None else rows, SEED_OF_HOP)
    return Commitment(
        hop=hop.node_id,
        entry=entry,
        session="cd" * 16,
        model=MODEL,
        layers=(3, 6),
        sketch_seed=SEED_OF_HOP,
        step=4,
        pos=10,
        count=rows.shape[0],
        inputs_digest=b"",
        inputs=sketch(rows * 0.5, SEED_OF_HOP),
        outputs=outputs,
        token=token,
    )


@pytest.fixture
def rows() -> np.ndarray:
    return np.random.default_rng(3).standard_normal((3, WIDTH)).astype(np.float32)


def _noisy(rows: np.ndarray) -> np.ndarray:
    noise = np.random.default_rng(4).standard_normal(rows.shape).astype(np.float32)
    return rows + 0.5 * float(rows.std()) * noise


def test_an_honest_handoff_is_taken_and_only_a_signed_one(rows: np.ndarray) -> None:
    hop, entry = Identity.generate(), Identity.generate()
    commitment = _commitment(hop, entry.node_id, rows)
    receipt = Receipt.of(commitment, rows_digest(rows)).signed(hop)
    assert check_handoff(commitment, receipt.signature, rows, row_digests(rows)) is None
    # The receipt is checked on every step: the receiver relays it to the
    # entry, where an unchecked one would prove nothing.
    unsigned = check_handoff(commitment, b"\0" * 64, rows, row_digests(rows))
    assert isinstance(unsigned, str) and "does not cover" in unsigned


def test_a_transit_liar_signs_its_own_conviction(rows: np.ndarray) -> None:
    """It commits the honest rows and forwards noise, with a receipt for what
    it sent: the receiver's proof names the sender alone, holds after a trip
    through JSON, and no altered copy of it does."""
    liar, entry = Identity.generate(), Identity.generate()
    commitment = _commitment(liar, entry.node_id, rows)
    sent = _noisy(rows)
    receipt = Receipt.of(commitment, rows_digest(sent)).signed(liar)
    proof = check_handoff(commitment, receipt.signature, sent, row_digests(sent))
    assert isinstance(proof, Contradiction) and proof.accused == liar.node_id
    assert "forwarded other activations" in proof.fault()
    carried = Contradiction.from_json(proof.to_json())
    assert carried.fault() == proof.fault()
    assert proof.row is not None
    # Another row than the one the receipt names, or a receipt signed by
    # someone else: neither is proof.
    with pytest.raises(ValueError, match="not the one the receipt names"):
        replace(carried, row=proof.row + 1).fault()
    framer = Receipt.of(commitment, rows_digest(sent)).signed(Identity.generate())
    with pytest.raises(ValueError, match="signature"):
        replace(carried, signature=framer.signature).fault()


def test_an_honest_sender_cannot_be_framed_with_its_own_receipt(rows: np.ndarray) -> None:
    """The receiver holds the honest sender's receipt for the rows it got;
    whatever row it shows, the proof fails: the honest rows agree with the
    commitment, and any other row is not the one the receipt names."""
    honest, entry = Identity.generate(), Identity.generate()
    commitment = _commitment(honest, entry.node_id, rows)
    receipt = Receipt.of(commitment, rows_digest(rows)).signed(honest)
    for row in (rows[1], _noisy(rows)[1]):
        framing = Contradiction(
            commitment, receipt.signature, digests=row_digests(rows), index=1, row=row
        )
        with pytest.raises(ValueError):
            framing.fault()


def test_rows_the_receipt_does_not_cover_are_refused_without_proof(rows: np.ndarray) -> None:
    sender, entry = Identity.generate(), Identity.generate()
    commitment = _commitment(sender, entry.node_id, rows)
    receipt = Receipt.of(commitment, rows_digest(rows)).signed(sender)  # for the honest rows
    noisy = _noisy(rows)
    refusal = check_handoff(commitment, receipt.signature, noisy, row_digests(noisy))
    assert isinstance(refusal, str) and "does not cover" in refusal
    short = check_handoff(commitment, receipt.signature, rows[:2], row_digests(rows[:2]))
    assert isinstance(short, str) and "does not cover the rows" in short


def test_every_emitted_token_must_be_the_signed_one(rows: np.ndarray) -> None:
    hop, entry = Identity.generate(), Identity.generate()
    commitment = _commitment(hop, entry.node_id, rows, token=17)
    honest = Receipt.of(commitment, token_digest(17)).signed(hop)
    assert check_emitted(commitment, honest.signature, 17) is None
    # It signed that it emits 18 for a commitment naming 17: proof.
    lying = Receipt.of(commitment, token_digest(18)).signed(hop)
    proof = check_emitted(commitment, lying.signature, 18)
    assert isinstance(proof, Contradiction) and proof.accused == hop.node_id
    assert "emitted token 18" in proof.fault() and "signed token 17" in proof.fault()
    # A token its receipt does not cover is not emitted, and proves nothing.
    refusal = check_emitted(commitment, honest.signature, 18)
    assert isinstance(refusal, str) and "does not verify" in refusal
    with pytest.raises(ValueError, match="committed one"):
        Contradiction(commitment, honest.signature, token=17).fault()


def test_contradiction_evidence_is_checked_on_arrival(rows: np.ndarray) -> None:
    """The leader takes a contradiction without recomputing: so from_json
    checks it whole, and names what is wrong with a forged one."""
    hop, entry = Identity.generate(), Identity.generate()
    commitment = _commitment(hop, entry.node_id, rows, token=17)
    receipt = Receipt.of(commitment, token_digest(18)).signed(hop)
    proof = check_emitted(commitment, receipt.signature, 18)
    assert isinstance(proof, Contradiction)
    evidence = Evidence(
        reporter=entry.node_id,
        kind="contradiction",
        hop_index=1,
        model=MODEL,
        prompt=(1, 2, 3),
        tokens=(),
        sampling=SamplingParams(temperature=0.0),
        seed=0,
        layers=((0, 3), (3, 6)),
        commitment=commitment,
        proof=proof,
    )
    carried = Evidence.from_json(evidence.to_json())
    assert carried.digest() == evidence.digest()
    body = evidence.to_json()
    body["proof"]["token"] = 17  # now the emitted token is the committed one
    with pytest.raises(ValueError, match="no contradiction"):
        Evidence.from_json(body)
    body = evidence.to_json()
    body["proof"] = None
    with pytest.raises(ValueError, match="needs the accused's receipt"):
        Evidence.from_json(body)
    for token in (-1, 2**64):  # no vocabulary has it: malformed, never an OverflowError
        body = evidence.to_json()
        body["proof"]["token"] = token
        with pytest.raises(ValueError, match="out of range"):
            Evidence.from_json(body)
    body = evidence.to_json()
    body["proof"]["digests"] = ["zz"]
    with pytest.raises(ValueError, match="malformed"):
        Evidence.from_json(body)
    body = evidence.to_json()
    body["reporter"] = Identity.generate().node_id.hex()
    with pytest.raises(ValueError, match="another model or entry"):
        Evidence.from_json(body)


# --- on real shards ---------------------------------------------------------------


class TransitLiar(HopServer):
    """Commits each step honestly, then forwards noise: the issue's transit liar."""

    def _compute_step(self, session: Any, work: Any) -> Any:
        result = super()._compute_step(session, work)
        if result.hidden is None:
            return result
        return replace(result, hidden=_noisy(result.hidden))


class TokenMismatch(HopServer):
    """A last hop that commits the token it sampled and emits the next one."""

    def _compute_step(self, session: Any, work: Any) -> Any:
        result = super()._compute_step(session, work)
        if result.token is None:
            return result
        return replace(result, token=(result.token + 1) % self.shard.vocab_size)


async def _first_failure(
    shards: list[ShardBackend], liar: int, hop_class: type[HopServer]
) -> tuple[list[int], PipelineError, bytes]:
    async with trio.open_nursery() as nursery:
        entry = await start_node(nursery, "entry")
        hops = []
        for i, shard in enumerate(shards):
            kind = {"hop_class": hop_class} if i == liar else {}
            hops.append(await start_node(nursery, f"hop{i}", shard, **kind))
        chain = [node.as_hop() for node in hops]
        got: list[int] = []
        stream = entry.engine.pipeline.generate(
            MODEL, chain, PROMPT, GREEDY, seed=SEED, deadlines=FAST
        )
        with pytest.raises(PipelineError) as caught:
            async with aclosing(stream) as tokens:
                async for token in tokens:
                    got.append(token)
        nursery.cancel_scope.cancel()
    return got, caught.value, chain[liar].node


async def test_a_transit_liar_is_named_alone_before_its_noise_is_used(
    torch_shards: dict[tuple[int, int], ShardBackend],
) -> None:
    got, error, liar = await _first_failure([torch_shards[s] for s in SPANS], 0, TransitLiar)
    failure = error.failure
    assert got == [] and failure.step == 0  # the prefill's noise was refused
    assert failure.suspects == {liar.hex()}
    assert failure.proof is not None and failure.proof.accused == liar
    assert "forwarded other activations" in failure.proof.fault()


async def test_a_token_other_than_the_signed_one_is_never_emitted(
    torch_shards: dict[tuple[int, int], ShardBackend],
) -> None:
    got, error, liar = await _first_failure(
        [torch_shards[s] for s in SPANS], len(SPANS) - 1, TokenMismatch
    )
    failure = error.failure
    assert got == [] and failure.suspects == {liar.hex()}
    assert failure.proof is not None and failure.proof.token is not None
    assert "emitted token" in failure.proof.fault()


def test_a_token_receipt_proves_its_commitment_without_the_chain(rows: np.ndarray) -> None:
    """Only one commitment in SIGN_EVERY is signed, and a hop may withhold
    its seal; the receipt for each emitted token proves that step's
    commitment all the same, so a token lie is signed evidence."""
    hop, entry = Identity.generate(), Identity.generate()
    commitment = replace(_commitment(hop, entry.node_id, rows, token=17), pos=0, count=3)
    receipt = Receipt.of(commitment, token_digest(17)).signed(hop)
    assert receipted(commitment, receipt.signature)
    assert not receipted(replace(commitment, token=18), receipt.signature)
    evidence = Evidence(
        reporter=entry.node_id,
        kind="token",
        hop_index=1,
        model=MODEL,
        prompt=(1, 2, 3),
        tokens=(17,),
        sampling=SamplingParams(temperature=0.0),
        seed=0,
        layers=((0, 3), (3, 6)),
        commitment=commitment,
        receipt=receipt.signature,
    )
    assert Evidence.from_json(evidence.to_json()).digest() == evidence.digest()
    with pytest.raises(ValueError, match="signature"):
        Evidence.from_json({**evidence.to_json(), "receipt": ""})


class Equivocator(HopServer):
    """Commits each step honestly to the entry, and sends the next hop noise
    with another commitment, one that agrees with the noise: the next hop's
    check passes, and only the receipt it relays gives the sender away."""

    def _push(self, session: Any, work: Any, result: Any) -> None:
        if result.hidden is None or result.commitment is None:
            super()._push(session, work, result)
            return
        honest = result.commitment
        noisy = _noisy(result.hidden)
        other = replace(honest, outputs=sketch(noisy, honest.sketch_seed), signature=b"")
        receipt = Receipt.of(other, rows_digest(noisy)).signed(self.signer)
        forward = {
            "op": "forward",
            "session": session.next_session,
            "step": work.step,
            "pos": work.pos,
            "compute_us": [*work.compute_us, result.took_us],
            "handoff": _handoff_header(other, receipt.signature),
        }
        self.plane.send(session.next_addr, encode_message(forward, noisy), peer=session.next_node)
        commit = {"op": "commit", "session": session.id, **honest.header_fields()}
        self.plane.send(session.reply, encode_message(commit, honest.payload()), peer=session.entry)


async def _transcript_of(
    shards: list[ShardBackend], hop_classes: dict[int, type[HopServer]]
) -> tuple[Transcript, list[bytes]]:
    async with trio.open_nursery() as nursery:
        entry = await start_node(nursery, "entry")
        hops = []
        for i, shard in enumerate(shards):
            kind = {"hop_class": hop_classes[i]} if i in hop_classes else {}
            hops.append(await start_node(nursery, f"hop{i}", shard, **kind))
        chain = [node.as_hop() for node in hops]
        transcript = Transcript()
        stream = entry.engine.pipeline.generate(
            MODEL, chain, PROMPT, GREEDY, seed=SEED, deadlines=FAST, transcript=transcript
        )
        async with aclosing(stream) as tokens:
            async for _ in tokens:
                pass
        with trio.fail_after(5):
            while not transcript.complete():
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    return transcript, [hop.node for hop in chain]


async def test_a_hop_that_tells_the_entry_one_thing_and_the_next_hop_another_is_named(
    torch_shards: dict[tuple[int, int], ShardBackend],
) -> None:
    """Every hop signs what it received too (its input digest) and relays
    the sender's receipt; on an honest chain every relayed receipt names the
    commitment the entry holds, and an equivocating sender is named alone."""
    shards = [torch_shards[s] for s in SPANS]
    honest, _ = await _transcript_of(shards, {})
    assert find_equivocation(honest) is None
    assert len(honest.relays) == (len(SPANS) - 1) * len(honest.steps())
    for (index, step), (_, _) in honest.relays.items():
        assert honest.commitments[(index, step)].inputs_digest  # what it signs it received
    lied, nodes = await _transcript_of(shards, {0: Equivocator})
    proof = find_equivocation(lied)
    assert proof is not None and proof.accused == nodes[0]
    assert "another commitment for step 0" in proof.fault()
    carried = Contradiction.from_json(proof.to_json())
    assert carried.fault() == proof.fault()


class WrongKey(HopServer):
    """Signs its receipts with a key that is not its node's: its rows are
    covered by no receipt anyone can check."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.signer = Identity.generate()


class Framer(HopServer):
    """A middle hop that refuses an honest sender's rows with a proof it made
    up: the sender's real commitment and receipt, and a row it altered."""

    def _compute_step(self, session: Any, work: Any) -> Any:
        if work.handoff is None:
            return super()._compute_step(session, work)
        sender, signature = work.handoff
        altered = work.inputs[0] + 1.0
        made_up = Contradiction(
            sender, signature, digests=row_digests(work.inputs), index=0, row=altered
        )
        return replace(super()._compute_step(session, work), refusal=made_up)

    def _refuse(self, session: Any, step: int, refusal: Any) -> None:
        header = {"op": "error", "session": session.id, "step": step, "reason": "wrong_sent"}
        self._send(session.reply, session.entry, {**header, "proof": refusal.to_json()})
        self._close(session)


async def test_rows_no_receipt_covers_blame_both_hops_and_prove_nothing(
    torch_shards: dict[tuple[int, int], ShardBackend],
) -> None:
    """Either the sender sent bytes its key never signed, or the receiver
    says so falsely: the entry cannot tell, so it reroutes around both, and
    files nothing."""
    got, error, liar = await _first_failure([torch_shards[s] for s in SPANS], 0, WrongKey)
    failure = error.failure
    assert got == [] and failure.proof is None and "bad_handoff" in failure.reason
    assert liar.hex() in failure.suspects and len(failure.suspects) == 2


async def test_a_made_up_proof_blames_the_hop_that_made_it(
    torch_shards: dict[tuple[int, int], ShardBackend],
) -> None:
    """A receiver that frames its honest sender with a proof that does not
    hold is the one the entry suspects, and nothing is filed."""
    got, error, framer = await _first_failure([torch_shards[s] for s in SPANS], 1, Framer)
    failure = error.failure
    assert got == [] and failure.proof is None
    assert failure.suspects == {framer.hex()}
