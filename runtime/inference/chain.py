"""The entry side of the engine: drive a chain of hops, survive a dead one.

`Pipeline.generate` opens one session on every hop of a chain, sends the
prompt into the first hop as one `forward` (the prefill), then one `forward`
per generated token; the last hop sends each token back here. A step that
fails (an `error`, a `busy` at open, or no token by its deadline) closes the
chain and asks the caller's `reroute` for a new one, on which the prompt and
every token so far are replayed as one prefill, so the stream continues
exactly where it stopped. `replay` recomputes a finished generation for a
spot check. The message schema is in `runtime.inference.protocol`.

Failover, whom a failure blames, and why closing needs no shield:
docs/design/inference-protocol.md#the-entry-chains-failover-and-closing.
"""

from __future__ import annotations

import secrets
from collections import Counter, OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import trio

from mesh.identity import SIGNATURE_BYTES, node_id_text
from mesh.transport import Plane
from runtime.inference.blame import Contradiction, check_emitted
from runtime.inference.commitment import (
    CHAIN_DIGEST_BYTES,
    DIGEST_BYTES,
    SKETCH_DIMS,
    Commitment,
)
from runtime.inference.deadlines import (
    DEFAULT_DEADLINES,
    UNMEASURED_PACE,
    Deadlines,
    HopPace,
    Stall,
    find_stall,
)
from runtime.inference.protocol import (
    MAX_REASON_CHARS,
    OP_BUSY,
    OP_CLOSE,
    OP_COMMIT,
    OP_ERROR,
    OP_FORWARD,
    OP_OPEN,
    OP_OPENED,
    OP_SEAL,
    OP_TOKEN,
    R_BAD_FIELD,
    R_BAD_HANDOFF,
    R_NOT_SESSION_PEER,
    R_WRONG_SENT,
    BadMessage,
    LogprobRow,
    compute_us_field,
    encode_message,
    logprob_rows,
    new_session_id,
    sampling_header,
    session_field,
    uint_field,
)
from runtime.inference.transcript import Replay, Transcript
from runtime.model.sampling import SEED_MODULUS, SamplingParams

__all__ = [
    "COMMIT_WAIT_S",
    "MAX_REROUTES",
    "ChainHop",
    "ChainTiming",
    "Failure",
    "Logprobs",
    "Pipeline",
    "PipelineError",
    "Reroute",
    "replay",
]

# Reroutes one generation may take before it gives up. Each costs a replay of
# the whole history; a third consecutive failure means something is wrong
# beyond one dead volunteer (the entry's own network, a bad model), and the
# client is better served by an error than by more waiting.
MAX_REROUTES: Final = 3

# Replies one attempt's mailbox holds. One step has at most one reply per hop
# in flight (an opened/busy/error each, or a token), so this never fills in
# normal operation; when a buggy or hostile peer floods it, extra replies are
# dropped and counted rather than queued without bound.
MAILBOX_SIZE: Final = 64

R_STALE_REPLY: Final = "stale_reply"  # for a session or step we no longer wait on
R_MAILBOX_FULL: Final = "mailbox_full"
R_BAD_COMMITMENT: Final = "bad_commitment"  # sketches that do not fit the step

MAX_KEPT_SESSIONS: Final = 4096
"""Sessions whose commitments the entry still files after the session
closed: a middle hop sends its commitment after its activations, so the
last step's may arrive after the token (and the close). Each is a few
hundred bytes of bookkeeping; the oldest go first. Far more than the
sessions of the generations a node keeps for spot checks at once."""


@dataclass(frozen=True, slots=True)
class ChainHop:
    """One node in a chain: who, where its data plane listens, which layers,
    and what it is expected to take per step (its steps' deadlines follow)."""

    node_id: str
    address: str
    layers: tuple[int, int]
    pace: HopPace = UNMEASURED_PACE

    @property
    def node(self) -> bytes:
        """The node id as bytes: the key its data plane must prove."""
        return bytes.fromhex(self.node_id)


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a step failed, for the caller's ``reroute``.

    ``nodes`` are every node of the failed chain; ``suspects`` the ones the
    entry holds responsible (never empty): the node that reported an error
    or was busy, the nodes that never answered ``open``, or the node that
    held up a step past its deadline, which ``stall`` then describes.
    ``step`` is the index of the token that was being produced. ``proof``
    is set when the one suspect signed two accounts of the step that cannot
    both be true (runtime.inference.blame): evidence for the leader.
    """

    nodes: frozenset[str]
    suspects: frozenset[str]
    reason: str
    step: int
    stall: Stall | None = None
    proof: Contradiction | None = None


Reroute = Callable[[Failure], Awaitable[Sequence[ChainHop] | None]]


@dataclass
class ChainTiming:
    """Where a generation's compute went, hop by hop, by the hops' own clocks
    (each token carries every hop's time for its step).

    It describes the chain that produced the last token: a failover starts
    it afresh, since the new chain may have other hops. ``prefill_us`` is
    per hop for the step that produced the chain's first token (the prompt,
    or the replay after a failover), which was ``prefill_tokens`` long and
    took ``prefill_wall_s`` by the entry's clock (sent to token);
    ``decode_us`` sums the one-token steps after it, ``decode_steps`` counts
    them.
    """

    nodes: list[str] = field(default_factory=list)
    prefill_us: list[int] = field(default_factory=list)
    decode_us: list[int] = field(default_factory=list)
    decode_steps: int = 0
    prefill_tokens: int = 0
    prefill_wall_s: float = 0.0

    def restart(self, chain: Sequence[ChainHop]) -> None:
        self.nodes = [hop.node_id for hop in chain]
        self.prefill_us = [0] * len(chain)
        self.decode_us = [0] * len(chain)
        self.decode_steps = 0
        self.prefill_tokens = 0
        self.prefill_wall_s = 0.0

    def add_prefill(self, compute_us: Sequence[int], tokens: int, wall_s: float) -> None:
        """The chain's first step: its reports, its length, its wall time."""
        if len(compute_us) != len(self.nodes):
            return  # a hop that did not report: nothing to attribute
        self.prefill_us = list(compute_us)
        self.prefill_tokens = tokens
        self.prefill_wall_s = wall_s

    def add(self, compute_us: Sequence[int]) -> None:
        """A decode step's reports."""
        if len(compute_us) != len(self.nodes):
            return  # a hop that did not report: nothing to attribute
        self.decode_us = [a + b for a, b in zip(self.decode_us, compute_us, strict=True)]
        self.decode_steps += 1


@dataclass
class Logprobs:
    """The logprobs a generation asked the last hop for (``top``
    alternatives per token; the prompt's too with ``echo``), filled in as
    tokens arrive: ``prompt`` the rows of the prompt's tokens after its
    first (once the first step brought them), ``tokens`` one row per
    generated token."""

    top: int
    echo: bool = False
    prompt: list[LogprobRow] | None = None
    tokens: list[LogprobRow] = field(default_factory=list)

    def asked(self, prompt: Sequence[int]) -> dict[str, Any]:
        """The ``open``'s ``logprobs`` for the last hop: the prompt's
        tokens are echoed until a step brought their rows."""
        echo = list(prompt[1:]) if self.echo and self.prompt is None else []
        return {"top": self.top, "echo": echo}

    def file(self, rows: Sequence[LogprobRow], echoed: int) -> bool:
        """A token's rows: ``echoed`` prompt rows first, then its own; False
        (nothing filed) when they are not that many."""
        if len(rows) != echoed + 1:
            return False
        if echoed:
            self.prompt = list(rows[:echoed])
        self.tokens.append(rows[-1])
        return True


class PipelineError(Exception):
    """Generation stopped: a step failed and no new chain was found (or the
    reroute budget ran out). ``failure`` is the last failure."""

    def __init__(self, failure: Failure, collected: Transcript | None = None) -> None:
        super().__init__(f"step {failure.step} failed: {failure.reason}")
        self.failure = failure
        self.collected = collected
        """A replay's own transcript (`replay`): what its chain committed
        before it failed, which a proof against one of its hops needs."""


@dataclass(frozen=True, slots=True)
class _Reply:
    op: str
    session: str
    step: int | None = None
    token: int | None = None
    reason: str = ""
    compute_us: tuple[int, ...] = ()
    commitment: Commitment | None = None
    picks: tuple[int, ...] = ()
    margins: tuple[float, ...] = ()
    logprobs: tuple[LogprobRow, ...] = ()
    proof: Contradiction | None = None
    """An error's proof against the hop before its sender, or a token's
    against its own sender (already checked: `Contradiction.fault`)."""
    unsigned: str = ""
    """Why a token is not emitted although no proof came with it: its
    receipt does not cover it."""


@dataclass(slots=True)
class _StepReports:
    """When each hop's commitment for the step in flight reached the entry
    (hop index -> the entry's clock): which hop held up a late step
    (:func:`find_stall`). Only the step in flight is kept."""

    step: int = -1
    at: dict[int, float] = field(default_factory=dict)

    def start(self, step: int) -> None:
        self.step = step
        self.at = {}

    def add(self, index: int, step: int, now: float) -> None:
        if step == self.step:
            self.at.setdefault(index, now)


@dataclass(frozen=True, slots=True)
class _Filing:
    """Where a session's commitments go: which hop of which transcript,
    and what the entry told that hop (the commitment's unsigned context);
    ``reports`` takes when the commitment of the step in flight arrived."""

    transcript: Transcript
    index: int
    hop: bytes
    model: str
    layers: tuple[int, int]
    sketch_seed: int
    budget: int  # positions the session may use: no step or position lies beyond
    reports: _StepReports
    logprobs_top: int | None = None  # the last hop's, when the generation asked


class _StepFailed(Exception):
    def __init__(
        self,
        suspects: frozenset[str],
        reason: str,
        stall: Stall | None = None,
        proof: Contradiction | None = None,
    ) -> None:
        super().__init__(reason)
        self.suspects = suspects
        self.reason = reason
        self.stall = stall
        self.proof = proof

    def failure(self, nodes: frozenset[str], step: int) -> Failure:
        """This failure of a step towards token ``step`` on ``nodes``."""
        return Failure(nodes, self.suspects, self.reason, step, self.stall, self.proof)


class _Attempt:
    """Sessions on one chain: opened together, closed together."""

    def __init__(
        self,
        pipeline: Pipeline,
        chain: Sequence[ChainHop],
        model: str,
        budget: int,
        params: SamplingParams,
        seed: int,
        transcript: Transcript,
        deadlines: Deadlines,
        *,
        check: dict[str, Any] | None = None,
        sketch_seeds: Sequence[int] | None = None,
        logprobs: dict[str, Any] | None = None,
        generated: Sequence[int] = (),
    ) -> None:
        self.pipeline = pipeline
        self.generated = tuple(generated)  # tokens before this chain: the last hop's history
        self.logprobs = logprobs  # the last hop's open asks for them (Logprobs.asked)
        self.chain = chain
        self.model = model
        self.budget = budget
        self.params = params
        self.seed = seed
        self.deadlines = deadlines
        self.check = check
        self.sessions = [new_session_id() for _ in chain]
        self.reports = _StepReports()
        # The step in flight: when it was sent, what each hop is expected to take.
        self.sent_at = 0.0
        self.expected: list[float] = []
        # Drawn here, told to each hop alone: a hop cannot know the
        # projection its neighbours sketch with (runtime.inference.commitment).
        self.sketch_seeds = list(sketch_seeds or [secrets.randbelow(SEED_MODULUS) for _ in chain])
        transcript.restart([h.node for h in chain], [h.layers for h in chain], self.sketch_seeds)
        for index, (session, hop) in enumerate(zip(self.sessions, chain, strict=True)):
            seed_of_hop = self.sketch_seeds[index]
            filing = _Filing(
                transcript, index, hop.node, model, hop.layers, seed_of_hop, budget, self.reports,
                None if logprobs is None or index < len(chain) - 1 else logprobs["top"],
            )  # fmt: skip
            pipeline.file_commitments(session, filing)
        self.node_of = {s: hop.node_id for s, hop in zip(self.sessions, chain, strict=True)}
        self.nodes = frozenset(hop.node_id for hop in chain)
        self.inbox_send, self.inbox = trio.open_memory_channel[_Reply](MAILBOX_SIZE)
        self.prefilled = False

    async def open(self) -> None:
        """Open every hop's session; all must answer ``opened`` in time."""
        plane = self.pipeline.plane
        for session, hop in zip(self.sessions, self.chain, strict=True):
            self.pipeline._mailboxes[session] = (hop.node, self.inbox_send)
        last = len(self.chain) - 1
        entry = plane.keys.node_id
        for i, (hop, session) in enumerate(zip(self.chain, self.sessions, strict=True)):
            header: dict[str, Any] = {
                "op": OP_OPEN,
                "session": session,
                "model": self.model,
                "layers": list(hop.layers),
                "reply": self.pipeline.reply_address,
                "budget": self.budget,
                "prev": (entry if i == 0 else self.chain[i - 1].node).hex(),
                "next": None if i == last else self.chain[i + 1].address,
                "next_node": None if i == last else self.chain[i + 1].node_id,
                "next_session": None if i == last else self.sessions[i + 1],
                "sampling": sampling_header(self.params) if i == last else None,
                "seed": self.seed,
                "sketch_seed": self.sketch_seeds[i],
                "check": self.check if i == last else None,
                "logprobs": self.logprobs if i == last else None,
                **(self._last_hop_history() if i == last else {}),
            }
            plane.send(hop.address, encode_message(header), peer=hop.node)
        waiting = set(self.sessions)
        with trio.move_on_after(self.deadlines.open_s):
            while waiting:
                reply = await self.inbox.receive()
                if reply.op == OP_OPENED:
                    waiting.discard(reply.session)
                elif reply.op in (OP_BUSY, OP_ERROR):
                    raise self.failed(reply)
                else:
                    self.pipeline._drops[f"engine.{R_STALE_REPLY}"] += 1
        if waiting:
            raise _StepFailed(frozenset(self.node_of[s] for s in waiting), "open timed out")

    def _last_hop_history(self) -> dict[str, Any]:
        """The ``open``'s fields that the last hop's penalties and constraint
        need: the constraint, and the tokens generated before this chain."""
        constraint = self.params.constraint
        needs_history = constraint is not None or self.params.presence_penalty != 0
        needs_history = needs_history or self.params.frequency_penalty != 0
        return {
            "constraint": None if constraint is None else constraint.header(),
            "generated": list(self.generated) if needs_history and self.generated else None,
        }

    def send_step(self, prompt: Sequence[int], tokens: Sequence[int]) -> tuple[int, float]:
        """Start producing token ``len(tokens)``: a prefill of the whole
        history on this chain's first step (a replay after failover), else
        one decode. Returns the step and how long to wait for its token:
        the deadline of what the hops are expected to take for it."""
        step = len(tokens)
        prefill = not self.prefilled
        if prefill:
            inputs = np.array([*prompt, *tokens], dtype=np.int64)
            pos = 0
            self.prefilled = True
        else:
            inputs = np.array(tokens[-1:], dtype=np.int64)
            pos = len(prompt) + step - 1
        self.expected = [hop.pace.step_s(len(inputs), prefill=prefill) for hop in self.chain]
        header = {"op": OP_FORWARD, "session": self.sessions[0], "step": step, "pos": pos}
        first = self.chain[0]
        self.sent_at = trio.current_time()
        self.reports.start(step)
        self.pipeline.plane.send(first.address, encode_message(header, inputs), peer=first.node)
        return step, self.deadlines.step_s(self.expected)

    async def receive_token(self, step: int, timeout: float) -> _Reply:
        """The ``token`` reply of ``step``, from the last hop; past the
        deadline, the hop that held the step up is the suspect."""
        last_session = self.sessions[-1]
        with trio.move_on_after(timeout):
            while True:
                reply = await self.inbox.receive()
                if reply.op == OP_TOKEN and reply.session == last_session and reply.step == step:
                    if reply.proof is not None or reply.unsigned:
                        raise self.failed(reply)  # never emitted: the stream stops here
                    return reply
                if reply.op in (OP_ERROR, OP_BUSY):  # busy: displaced for a newcomer
                    raise self.failed(reply)
                self.pipeline._drops[f"engine.{R_STALE_REPLY}"] += 1
        reported = [self.reports.at.get(i) for i in range(len(self.chain))]
        nodes = [hop.node_id for hop in self.chain]
        now = trio.current_time()
        stall = find_stall(nodes, self.expected, self.sent_at, reported, now)
        held = "has not reported after" if stall.silent else "took"
        reason = (
            f"no token within {timeout:.3g} s: hop {stall.index} ({stall.node[:12]}) "
            f"{held} {stall.held_s:.3g} s, expected {stall.expected_s:.3g} s"
        )
        raise _StepFailed(frozenset({stall.node}), reason, stall)

    def failed(self, reply: _Reply) -> _StepFailed:
        """Whom a refusal blames: the sender a proof names (the hop before
        an error's sender, or a token's own sender), alone; for a forward
        refused without proof (``bad_handoff``), the refusing hop and its
        sender, since either may be lying; else the hop that answered."""
        node = self.node_of[reply.session]
        reason = f"{reply.op}: {reply.reason or reply.unsigned}"
        proof = reply.proof
        if proof is not None:
            sender: tuple[bytes, str] | None = (proof.accused, reply.session)
            if reply.op != OP_TOKEN:
                sender = self.sender_of(reply.session)
            if sender == (proof.accused, proof.commitment.session):
                accused = node_id_text(proof.accused)
                return _StepFailed(frozenset({accused}), reason, proof=proof)
            return _StepFailed(frozenset({node}), f"{reason} (a proof about another session)")
        index = self.sessions.index(reply.session)
        if reply.reason.startswith(R_BAD_HANDOFF) and index > 0:
            return _StepFailed(frozenset({node, self.chain[index - 1].node_id}), reason)
        return _StepFailed(frozenset({node}), reason)

    def file_logprobs(self, record: Logprobs | None, reply: _Reply, *, first: bool) -> None:
        """File a token's logprobs in ``record``, if any (the echoed prompt's
        with the chain's first); a last hop whose rows do not fit the step
        fails it."""
        if record is None or self.logprobs is None:
            return
        echoed = len(self.logprobs["echo"]) if first else 0
        if not record.file(reply.logprobs, echoed):
            reason = "the last hop's logprobs do not fit the step"
            raise _StepFailed(frozenset({self.chain[-1].node_id}), reason)

    def sender_of(self, session: str) -> tuple[bytes, str] | None:
        """The hop that forwards into ``session`` and its own session (what
        a proof against it must name), or None for the first hop (the entry
        feeds it)."""
        index = self.sessions.index(session)
        if index == 0:
            return None
        return self.chain[index - 1].node, self.sessions[index - 1]

    def time_step(self, timing: ChainTiming, reply: _Reply, prefill: int, *, first: bool) -> None:
        """File a token's compute reports in `timing`: the chain's first
        step (`first`: a prefill of `prefill` tokens, timed from its send),
        else a decode step."""
        if first:
            timing.add_prefill(reply.compute_us, prefill, trio.current_time() - self.sent_at)
        else:
            timing.add(reply.compute_us)

    def close(self) -> None:
        """Close every session (synchronous: sends never block or raise)."""
        plane = self.pipeline.plane
        for hop, session in zip(self.chain, self.sessions, strict=True):
            self.pipeline._mailboxes.pop(session, None)
            close = encode_message({"op": OP_CLOSE, "session": session})
            plane.send(hop.address, close, peer=hop.node)
        self.inbox_send.close()


class Pipeline:
    """The entry side of a node's engine: drives generations over chains.

    Replies reach it through :meth:`handle`, called by the
    :class:`runtime.inference.dispatch.Engine` receive loop.
    """

    def __init__(
        self, plane: Plane, *, drops: Counter[str], reply_address: str | None = None
    ) -> None:
        self.plane = plane
        # Where hops send replies: the node's advertised data address (the
        # bound one, e.g. tcp://0.0.0.0:port, may not be reachable by peers).
        self.reply_address = reply_address or plane.address
        self._drops = drops
        # session id -> (the hop it was opened on, the generation's mailbox)
        self._mailboxes: dict[str, tuple[bytes, trio.MemorySendChannel[_Reply]]] = {}
        # session id -> where its commitments go (kept past the close)
        self._filings: OrderedDict[str, _Filing] = OrderedDict()

    def file_commitments(self, session: str, filing: _Filing) -> None:
        """File ``session``'s commitments in ``filing``'s transcript, from
        now until ``MAX_KEPT_SESSIONS`` later sessions push it out."""
        self._filings[session] = filing
        while len(self._filings) > MAX_KEPT_SESSIONS:
            self._filings.popitem(last=False)

    def handle(
        self,
        peer: bytes,
        op: str,
        header: Mapping[str, Any],
        dtype: str = "uint8",
        shape: tuple[int, ...] = (0,),
        raw: Any = b"",
    ) -> None:
        """Route one reply from node ``peer`` to the generation waiting for
        it, if ``peer`` is the hop its session was opened on (so a token only
        from the last hop), and file a commitment (``commit``, or the one a
        ``token`` carries) in its transcript; count the rest."""
        try:
            session = session_field(header)
            reply = _Reply(op=op, session=session)
            if op in (OP_TOKEN, OP_COMMIT, OP_SEAL):
                filing = self._filings.get(session)
                if filing is None:
                    raise BadMessage(R_STALE_REPLY, "a session whose commitments are not kept")
                if filing.hop != peer:
                    raise BadMessage(R_NOT_SESSION_PEER)
                if op == OP_SEAL:
                    signature = _bytes_field(header, "sig", (SIGNATURE_BYTES,))
                    filing.transcript.seal(filing.index, uint_field(header, "step"), signature)
                    return
                commitment = _commitment(
                    filing, self.plane.keys.node_id, session, header, dtype, shape, raw
                )
                filing.transcript.add(filing.index, commitment)
                filing.reports.add(filing.index, commitment.step, trio.current_time())
                relay = _relay(header)
                if relay is not None and filing.index > 0:
                    filing.transcript.relays[(filing.index, commitment.step)] = relay
                if op == OP_COMMIT:
                    return
                reply = _token_reply(filing, session, commitment, header)
            elif op in (OP_BUSY, OP_ERROR):
                reason = header.get("reason")
                if type(reason) is not str:
                    raise BadMessage("bad_field", "reason must be text")
                proof = self._proof(header) if reason.startswith(R_WRONG_SENT) else None
                reply = _Reply(op, session, reason=reason[:MAX_REASON_CHARS], proof=proof)
        except BadMessage as exc:
            self._drops[f"engine.{exc.reason}"] += 1
            return
        bound = self._mailboxes.get(session)
        if bound is None:
            self._drops[f"engine.{R_STALE_REPLY}"] += 1
            return
        hop, mailbox = bound
        if peer != hop:
            self._drops[f"engine.{R_NOT_SESSION_PEER}"] += 1
            return
        try:
            mailbox.send_nowait(reply)
        except (trio.WouldBlock, trio.ClosedResourceError):
            self._drops[f"engine.{R_MAILBOX_FULL}"] += 1

    def _proof(self, header: Mapping[str, Any]) -> Contradiction | None:
        """An error's proof against the hop before its sender, if it holds
        (`Contradiction.fault`); a malformed or false one is dropped
        (counted), and the error blames its sender like any other."""
        value = header.get("proof")
        try:
            if not isinstance(value, Mapping):
                raise ValueError("no proof")
            proof = Contradiction.from_json(value)
            proof.fault()
        except ValueError:
            self._drops["engine.bad_proof"] += 1
            return None
        if proof.commitment.entry != self.plane.keys.node_id:
            self._drops["engine.bad_proof"] += 1
            return None
        return proof

    async def generate(
        self,
        model: str,
        chain: Sequence[ChainHop],
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        seed: int,
        context_window: int | None = None,
        reroute: Reroute | None = None,
        deadlines: Deadlines = DEFAULT_DEADLINES,
        max_reroutes: int = MAX_REROUTES,
        timing: ChainTiming | None = None,
        transcript: Transcript | None = None,
        logprobs: Logprobs | None = None,
    ) -> AsyncGenerator[int, None]:
        """Yield the token ids generated from ``prompt_ids`` through ``chain``
        (hops in layer order, covering every layer).

        ``seed`` is ``params.seed`` when the client sent one, else one the
        caller drew for this request (see :func:`runtime.model.sampling.sample`).
        It yields ``params.max_tokens`` tokens, capped by what fits in
        ``context_window`` positions (the model's), or fills the window when
        ``params.max_tokens`` is None. End-of-sequence tokens and stop
        sequences are the caller's business: it stops iterating, and the
        sessions are closed. One step is always in flight while the caller
        holds a token (the next one is sent before it is yielded), so a
        caller that stops early has cost the chain one step more. Each
        step's deadline is ``deadlines``' rule over what the chain's hops
        are expected to take for it (their :attr:`ChainHop.pace`).

        ``timing``, when given, is kept up to date as tokens arrive, and so
        is ``transcript``: the chain, the tokens and every hop's signed
        commitment, for a spot check (:mod:`runtime.inference.transcript`),
        and ``logprobs``, the last hop's rows of each token yielded.

        Raises :class:`PipelineError` when a step fails and ``reroute`` is
        absent, returns ``None``, or has been asked ``max_reroutes`` times
        already; ``ValueError`` for a malformed chain, an empty prompt, a
        prompt that fills the context window, or no limit at all.
        """
        _check_chain(chain)
        prompt, limit = _prompt_and_limit(prompt_ids, params.max_tokens, context_window)
        transcript = transcript or Transcript()
        transcript.begin(model, tuple(prompt), params, seed % SEED_MODULUS)
        tokens = transcript.tokens
        reroutes = 0
        timing = timing or ChainTiming()
        while len(tokens) < limit:
            attempt = _Attempt(
                self, chain, model, len(prompt) + limit, params, transcript.seed, transcript,
                deadlines, logprobs=None if logprobs is None else logprobs.asked(prompt),
                generated=tokens,
            )  # fmt: skip
            timing.restart(chain)
            try:
                await attempt.open()
                start = len(tokens)
                pending = attempt.send_step(prompt, tokens)
                while True:
                    reply = await attempt.receive_token(*pending)
                    first = len(tokens) == start
                    attempt.time_step(timing, reply, len(prompt) + start, first=first)
                    attempt.file_logprobs(logprobs, reply, first=first)
                    assert reply.token is not None
                    tokens.append(reply.token)
                    if len(tokens) < limit:
                        # Sent before this token goes to the caller, so the
                        # chain computes while the caller detokenizes; if the
                        # caller stops here (end of sequence, a stop sequence)
                        # the step is wasted, and its late token a stale_reply.
                        pending = attempt.send_step(prompt, tokens)
                    yield reply.token
                    if len(tokens) == limit:
                        return
            except _StepFailed as exc:
                failure = exc.failure(attempt.nodes, len(tokens))
            finally:
                attempt.close()
            reroutes += 1
            chain = await _next_chain(failure, reroute if reroutes <= max_reroutes else None)


async def _next_chain(failure: Failure, reroute: Reroute | None) -> Sequence[ChainHop]:
    """The chain to continue on after `failure`: `reroute`'s; PipelineError
    when there is none (no `reroute`, the budget spent, or it gave up)."""
    if reroute is None:
        raise PipelineError(failure)
    new_chain = await reroute(failure)
    if new_chain is None:
        raise PipelineError(failure)
    _check_chain(new_chain)
    return new_chain


COMMIT_WAIT_S: Final = 2.0
"""How long a replay waits, after its token, for the other hops'
commitments (each hop sends its own right after its activations)."""
COMMIT_POLL_S: Final = 0.01


async def replay(
    pipeline: Pipeline,
    chain: Sequence[ChainHop],
    transcript: Transcript,
    *,
    sketch_seeds: Sequence[int],
    deadlines: Deadlines = DEFAULT_DEADLINES,
) -> Replay:
    """Recompute a finished generation on ``chain`` (the same layer spans
    as the transcript's chain, other nodes where the swarm has them): the
    whole history ``prompt + tokens[:-1]`` as one prefill, each hop
    sketching with ``sketch_seeds`` (the seeds of the hops it checks), the
    last hop judging every claimed token. Raises PipelineError when the
    replay chain fails or a hop's commitment never comes."""
    _check_chain(chain)
    prompt, tokens = transcript.prompt, transcript.tokens
    if not prompt or not tokens:
        raise ValueError("a replay needs a prompt and at least one generated token")
    ids = [*prompt, *tokens[:-1]]
    collector = Transcript(transcript.model, prompt, transcript.sampling, transcript.seed)
    check = {"from": len(prompt) - 1, "tokens": list(tokens)}
    attempt = _Attempt(
        pipeline,
        chain,
        transcript.model,
        len(ids),
        transcript.sampling,
        transcript.seed,
        collector,
        deadlines,
        check=check,
        sketch_seeds=sketch_seeds,
    )
    try:
        await attempt.open()
        reply = await attempt.receive_token(*attempt.send_step(ids, []))
        with trio.move_on_after(COMMIT_WAIT_S):
            while len(collector.commitments) < len(chain):
                await trio.sleep(COMMIT_POLL_S)
    except _StepFailed as exc:
        raise PipelineError(exc.failure(attempt.nodes, 0), collector) from None
    finally:
        attempt.close()
    missing = [hop.node_id for i, hop in enumerate(chain) if (i, 0) not in collector.commitments]
    if missing:
        raise PipelineError(Failure(attempt.nodes, frozenset(missing), "no commitment", 0))
    commitments = tuple(collector.commitments[(i, 0)] for i in range(len(chain)))
    return Replay(commitments, reply.picks, reply.margins, collector)


def _commitment(
    filing: _Filing,
    entry: bytes,
    session: str,
    header: Mapping[str, Any],
    dtype: str,
    shape: tuple[int, ...],
    raw: Any,
) -> Commitment:
    """The commitment a ``commit`` or ``token`` message carries, with the
    context the entry gave the hop; BadMessage when it is malformed (its
    signature is checked only when it becomes evidence: verifying every
    step's would cost the entry more than the hops' signing)."""
    count = uint_field(header, "count")
    in_rows = uint_field(header, "in_rows")
    digest = header.get("in_digest")
    signature = _bytes_field(header, "sig", (0, SIGNATURE_BYTES))
    previous = _bytes_field(header, "prev", (0, CHAIN_DIGEST_BYTES))
    if type(digest) is not bytes or len(digest) not in (0, DIGEST_BYTES):
        raise BadMessage(R_BAD_FIELD, "in_digest must be 0 or 16 bytes")
    if dtype != "float32" or len(shape) != 2 or shape[1] != SKETCH_DIMS:
        raise BadMessage(R_BAD_COMMITMENT, f"sketches must be float32 [n, {SKETCH_DIMS}]")
    step, pos = uint_field(header, "step"), uint_field(header, "pos")
    if count < 1 or in_rows not in (0, count) or shape[0] <= in_rows or shape[0] > 2 * count:
        raise BadMessage(R_BAD_COMMITMENT, "sketch rows do not match the step")
    if step >= filing.budget or pos + count > filing.budget:
        # A transcript holds one commitment per hop and step of a budget:
        # steps beyond it would let a hop grow the entry's memory at will.
        raise BadMessage(R_BAD_COMMITMENT, "step or positions beyond the session's budget")
    rows = np.frombuffer(raw, dtype=np.float32).reshape(shape)
    token = header.get("ctoken")  # a token's commitment: the token it signed
    return Commitment(
        hop=filing.hop,
        entry=entry,
        session=session,
        model=filing.model,
        layers=filing.layers,
        sketch_seed=filing.sketch_seed,
        step=step,
        pos=pos,
        count=count,
        inputs_digest=digest,
        inputs=rows[:in_rows],
        outputs=rows[in_rows:],
        token=token if isinstance(token, int) and not isinstance(token, bool) else None,
        previous=previous,
        signature=signature,
    )


def _token_reply(
    filing: _Filing, session: str, commitment: Commitment, header: Mapping[str, Any]
) -> _Reply:
    """A ``token`` message as the generation sees it, checked before its
    token may be emitted: is it the one the last hop signed
    (`runtime.inference.blame.check_emitted`)? A checked receipt is kept:
    it proves the step's commitment for a spot check."""
    token = uint_field(header, "token")
    receipt = _bytes_field(header, "receipt", (SIGNATURE_BYTES,))
    checked = check_emitted(commitment, receipt, token)
    if checked is None:
        filing.transcript.receipts[(filing.index, commitment.step)] = receipt
    return _Reply(
        OP_TOKEN,
        session,
        step=commitment.step,
        token=token,
        compute_us=compute_us_field(header),
        commitment=commitment,
        picks=_ints(header.get("picks", [])),
        margins=_floats(header.get("margins", [])),
        logprobs=() if filing.logprobs_top is None else logprob_rows(header, filing.logprobs_top),
        proof=checked if isinstance(checked, Contradiction) else None,
        unsigned=checked if isinstance(checked, str) else "",
    )


def _relay(header: Mapping[str, Any]) -> tuple[bytes, bytes] | None:
    """The handoff a hop took its step on (`HopServer`'s relay): the digest
    of the sender's commitment and its receipt; None when absent."""
    if header.get("from_digest") is None:
        return None
    digest = _bytes_field(header, "from_digest", (CHAIN_DIGEST_BYTES,))
    return digest, _bytes_field(header, "from_receipt", (SIGNATURE_BYTES,))


def _bytes_field(header: Mapping[str, Any], key: str, sizes: tuple[int, ...]) -> bytes:
    value = header.get(key)
    if type(value) is not bytes or len(value) not in sizes:
        raise BadMessage(
            R_BAD_FIELD, f"{key} must be bytes of length {' or '.join(map(str, sizes))}"
        )
    return value


def _ints(value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise BadMessage(R_BAD_FIELD, "picks must be a list of token ids")
    return tuple(value)


def _floats(value: object) -> tuple[float, ...]:
    if not isinstance(value, list) or not all(type(v) in (int, float) for v in value):
        raise BadMessage(R_BAD_FIELD, "margins must be a list of numbers")
    return tuple(float(v) for v in value)


def _prompt_and_limit(
    prompt_ids: Sequence[int], max_tokens: int | None, context_window: int | None
) -> tuple[list[int], int]:
    """The prompt as ints, and how many tokens to generate (`_token_limit`)."""
    if not prompt_ids:
        raise ValueError("the prompt needs at least one token")
    prompt = [int(t) for t in prompt_ids]
    return prompt, _token_limit(len(prompt), max_tokens, context_window)


def _token_limit(prompt: int, max_tokens: int | None, context_window: int | None) -> int:
    """How many tokens to generate: max_tokens, capped by the context window."""
    if context_window is None:
        if max_tokens is None:
            raise ValueError("need max_tokens or a context window to bound generation")
        return max_tokens
    if prompt >= context_window:
        raise ValueError(f"prompt of {prompt} tokens fills the context window ({context_window})")
    room = context_window - prompt
    return room if max_tokens is None else min(max_tokens, room)


def _check_chain(chain: Sequence[ChainHop]) -> None:
    """Hops must tile contiguous layers from 0 (the last hop must hold the
    model's last layer; only that hop itself can check it)."""
    if not chain:
        raise ValueError("a chain needs at least one hop")
    start = 0
    for hop in chain:
        if len(hop.node_id) != 64 or not all(c in "0123456789abcdef" for c in hop.node_id):
            raise ValueError(f"hop {hop.node_id!r} is not a node id (64 lowercase hex digits)")
        a, b = hop.layers
        if a != start or b <= a:
            raise ValueError(f"chain layers must be contiguous from 0, got {hop.layers} at {start}")
        start = b
