"""The entry side of the engine: drive a chain of hops, survive a dead one.

:meth:`Pipeline.generate` opens one session on every hop of a chain, sends
the prompt into the first hop as one ``forward`` (the prefill), then one
``forward`` per generated token; each hop pushes its activations straight to
the next and the last hop samples and sends the token back here. The
message schema is in :mod:`runtime.inference.protocol`.

Failover
========
A step *fails* when a hop answers ``error`` (or ``busy`` at open), or when
no token arrives within the step's timeout (:class:`Timeouts`). The entry
then cannot always tell which hop died: a token that never came could have
been lost at any hop. So it does not guess: it closes the failed chain's
sessions and hands the caller a :class:`Failure` with *all* of the chain's
node ids plus a hint (``suspects``: the hop that reported the error or was
busy, or the hops that never answered ``open``; empty after a plain
timeout). The caller's ``reroute`` decides with what it knows — membership
marks a dead process suspect within a probe interval or two — and returns a
new chain, or ``None`` to give up. On the new chain the entry opens fresh
sessions and *replays* the prompt plus every token generated so far as one
prefill, so the new hops rebuild their caches; the replay's ``step`` is the
index of the next token, so the stream continues exactly where it stopped:
no token is repeated or skipped, and because the last hop samples with a
generator seeded by (seed, step), the continuation is the one an
uninterrupted run would have produced.

Closing
=======
Sessions are closed when generation ends, fails over, or the consumer stops
iterating (``break``, an exception, cancellation, a client disconnect).
Closing is a few :meth:`mesh.transport.Plane.send` calls, which never block
and never raise, so it runs synchronously in ``finally`` and needs no
shielded cancel scope. Consumers should still wrap the generator in
``contextlib.aclosing`` so that ``finally`` runs at once rather than when the
generator is garbage-collected. A close that is lost is covered by the hops'
idle reaper.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import trio

from mesh.transport import Plane
from runtime.inference.protocol import (
    MAX_REASON_CHARS,
    OP_BUSY,
    OP_CLOSE,
    OP_ERROR,
    OP_FORWARD,
    OP_OPEN,
    OP_OPENED,
    OP_TOKEN,
    R_NOT_SESSION_PEER,
    BadMessage,
    compute_us_field,
    encode_message,
    new_session_id,
    sampling_header,
    session_field,
    uint_field,
)
from runtime.model.sampling import SEED_MODULUS, SamplingParams

__all__ = [
    "DEFAULT_TIMEOUTS",
    "MAX_REROUTES",
    "ChainTiming",
    "Failure",
    "Hop",
    "Pipeline",
    "PipelineError",
    "Reroute",
    "Timeouts",
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


@dataclass(frozen=True, slots=True)
class Hop:
    """One node in a chain: who, where its data plane listens, which layers."""

    node_id: str
    address: str
    layers: tuple[int, int]

    @property
    def node(self) -> bytes:
        """The node id as bytes: the key its data plane must prove."""
        return bytes.fromhex(self.node_id)


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a step failed, for the caller's ``reroute``.

    ``nodes`` are every node of the failed chain (the entry cannot always
    tell which one died); ``suspects`` is a hint, possibly empty: the node
    that reported an error or was busy, or the nodes that never answered
    ``open``. ``step`` is the index of the token that was being produced.
    """

    nodes: frozenset[str]
    suspects: frozenset[str]
    reason: str
    step: int


Reroute = Callable[[Failure], Awaitable[Sequence[Hop] | None]]


@dataclass
class ChainTiming:
    """Where a generation's compute went, hop by hop, by the hops' own clocks
    (each token carries every hop's time for its step).

    It describes the chain that produced the last token: a failover starts
    it afresh, since the new chain may have other hops. ``prefill_us`` is
    per hop for the step that produced the chain's first token (the prompt,
    or the replay after a failover); ``decode_us`` sums the one-token steps
    after it, ``decode_steps`` counts them.
    """

    nodes: list[str] = field(default_factory=list)
    prefill_us: list[int] = field(default_factory=list)
    decode_us: list[int] = field(default_factory=list)
    decode_steps: int = 0

    def restart(self, chain: Sequence[Hop]) -> None:
        self.nodes = [hop.node_id for hop in chain]
        self.prefill_us = [0] * len(chain)
        self.decode_us = [0] * len(chain)
        self.decode_steps = 0

    def add(self, compute_us: Sequence[int], *, prefill: bool) -> None:
        if len(compute_us) != len(self.nodes):
            return  # a hop that did not report: nothing to attribute
        if prefill:
            self.prefill_us = list(compute_us)
        else:
            self.decode_us = [a + b for a, b in zip(self.decode_us, compute_us, strict=True)]
            self.decode_steps += 1


class PipelineError(Exception):
    """Generation stopped: a step failed and no new chain was found (or the
    reroute budget ran out). ``failure`` is the last failure."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(f"step {failure.step} failed: {failure.reason}")
        self.failure = failure


@dataclass(frozen=True, slots=True)
class Timeouts:
    """How long the entry waits before it declares a step failed.

    open_s:
        For every hop of a chain to answer ``open`` (one round trip each,
        all in parallel, plus allocating an empty cache).
    prefill_base_s / prefill_per_token_s:
        A prefill of T tokens (the prompt, or a replay) may take
        ``prefill_base_s + T * prefill_per_token_s``: the base covers the
        chain's latency and a decode-sized step, the per-token part a slow
        volunteer's prefill throughput (5 ms per token is 200 tokens/s through
        the whole chain, a 7B-class model on a modest GPU).
    decode_step_s:
        One decode step through the whole chain. Healthy steps take tens of
        milliseconds; 2 s tolerates a loaded node and a WAN hop or two while
        keeping the stall a dead node causes short enough that a streaming
        client sees a pause, not a hang.
    Lower values fail over sooner but risk abandoning a slow, healthy chain
    (the replay then costs more than waiting would have).
    """

    open_s: float = 2.0
    prefill_base_s: float = 2.0
    prefill_per_token_s: float = 0.005
    decode_step_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("open_s", "prefill_base_s", "decode_step_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Timeouts.{name} must be positive")
        if not self.prefill_per_token_s >= 0:
            raise ValueError("Timeouts.prefill_per_token_s must be >= 0")

    def prefill_s(self, tokens: int) -> float:
        return self.prefill_base_s + tokens * self.prefill_per_token_s


DEFAULT_TIMEOUTS: Final = Timeouts()


@dataclass(frozen=True, slots=True)
class _Reply:
    op: str
    session: str
    step: int | None = None
    token: int | None = None
    reason: str = ""
    compute_us: tuple[int, ...] = ()


class _StepFailed(Exception):
    def __init__(self, suspects: frozenset[str], reason: str) -> None:
        super().__init__(reason)
        self.suspects = suspects
        self.reason = reason


class _Attempt:
    """Sessions on one chain: opened together, closed together."""

    def __init__(
        self,
        pipeline: Pipeline,
        chain: Sequence[Hop],
        model: str,
        budget: int,
        params: SamplingParams,
        seed: int,
    ) -> None:
        self.pipeline = pipeline
        self.chain = chain
        self.model = model
        self.budget = budget
        self.params = params
        self.seed = seed
        self.sessions = [new_session_id() for _ in chain]
        self.node_of = {s: hop.node_id for s, hop in zip(self.sessions, chain, strict=True)}
        self.nodes = frozenset(hop.node_id for hop in chain)
        self.inbox_send, self.inbox = trio.open_memory_channel[_Reply](MAILBOX_SIZE)
        self.prefilled = False

    async def open(self, timeout: float) -> None:
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
            }
            plane.send(hop.address, encode_message(header), peer=hop.node)
        waiting = set(self.sessions)
        with trio.move_on_after(timeout):
            while waiting:
                reply = await self.inbox.receive()
                if reply.op == OP_OPENED:
                    waiting.discard(reply.session)
                elif reply.op in (OP_BUSY, OP_ERROR):
                    raise _StepFailed(
                        frozenset({self.node_of[reply.session]}), f"{reply.op}: {reply.reason}"
                    )
                else:
                    self.pipeline._drops[f"engine.{R_STALE_REPLY}"] += 1
        if waiting:
            raise _StepFailed(frozenset(self.node_of[s] for s in waiting), "open timed out")

    def send_step(
        self, prompt: Sequence[int], tokens: Sequence[int], timeouts: Timeouts
    ) -> tuple[int, float]:
        """Start producing token ``len(tokens)``: a prefill of the whole
        history on this chain's first step (a replay after failover), else
        one decode. Returns the step and how long to wait for its token."""
        step = len(tokens)
        if self.prefilled:
            inputs = np.array(tokens[-1:], dtype=np.int64)
            pos = len(prompt) + step - 1
            timeout = timeouts.decode_step_s
        else:
            inputs = np.array([*prompt, *tokens], dtype=np.int64)
            pos = 0
            timeout = timeouts.prefill_s(len(inputs))
            self.prefilled = True
        header = {"op": OP_FORWARD, "session": self.sessions[0], "step": step, "pos": pos}
        first = self.chain[0]
        self.pipeline.plane.send(first.address, encode_message(header, inputs), peer=first.node)
        return step, timeout

    async def receive_token(self, step: int, timeout: float) -> _Reply:
        """The ``token`` reply of ``step``, from the last hop."""
        last_session = self.sessions[-1]
        with trio.move_on_after(timeout):
            while True:
                reply = await self.inbox.receive()
                if reply.op == OP_TOKEN and reply.session == last_session and reply.step == step:
                    return reply
                if reply.op == OP_ERROR:
                    raise _StepFailed(
                        frozenset({self.node_of[reply.session]}), f"error: {reply.reason}"
                    )
                self.pipeline._drops[f"engine.{R_STALE_REPLY}"] += 1
        raise _StepFailed(frozenset(), f"no token within {timeout:.3g} s")

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

    def handle(self, peer: bytes, op: str, header: Mapping[str, Any]) -> None:
        """Route one reply from node ``peer`` to the generation waiting for
        it, if ``peer`` is the hop its session was opened on (so a token only
        from the last hop); count the rest."""
        try:
            session = session_field(header)
            reply = _Reply(op=op, session=session)
            if op == OP_TOKEN:
                reply = _Reply(
                    op,
                    session,
                    step=uint_field(header, "step"),
                    token=uint_field(header, "token"),
                    compute_us=compute_us_field(header),
                )
            elif op in (OP_BUSY, OP_ERROR):
                reason = header.get("reason")
                if type(reason) is not str:
                    raise BadMessage("bad_field", "reason must be text")
                reply = _Reply(op, session, reason=reason[:MAX_REASON_CHARS])
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

    async def generate(
        self,
        model: str,
        chain: Sequence[Hop],
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        seed: int,
        context_window: int | None = None,
        reroute: Reroute | None = None,
        timeouts: Timeouts = DEFAULT_TIMEOUTS,
        max_reroutes: int = MAX_REROUTES,
        timing: ChainTiming | None = None,
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
        caller that stops early has cost the chain one step more.

        ``timing``, when given, is kept up to date as tokens arrive.

        Raises :class:`PipelineError` when a step fails and ``reroute`` is
        absent, returns ``None``, or has been asked ``max_reroutes`` times
        already; ``ValueError`` for a malformed chain, an empty prompt, a
        prompt that fills the context window, or no limit at all.
        """
        _check_chain(chain)
        if not prompt_ids:
            raise ValueError("the prompt needs at least one token")
        prompt = [int(t) for t in prompt_ids]
        limit = _token_limit(len(prompt), params.max_tokens, context_window)
        seed %= SEED_MODULUS  # clients may send negative seeds; sample() reduces alike
        tokens: list[int] = []
        reroutes = 0
        timing = timing or ChainTiming()
        while len(tokens) < limit:
            attempt = _Attempt(self, chain, model, len(prompt) + limit, params, seed)
            timing.restart(chain)
            try:
                await attempt.open(timeouts.open_s)
                pending = attempt.send_step(prompt, tokens, timeouts)
                first_of_chain = True
                while True:
                    reply = await attempt.receive_token(*pending)
                    timing.add(reply.compute_us, prefill=first_of_chain)
                    first_of_chain = False
                    assert reply.token is not None
                    token = reply.token
                    tokens.append(token)
                    if len(tokens) < limit:
                        # The next step goes out before this token goes to
                        # the caller, so the chain computes while the caller
                        # detokenizes and streams. If the caller stops here
                        # (an end-of-sequence token, a stop sequence), that
                        # step is wasted work, and its late token a
                        # stale_reply.
                        pending = attempt.send_step(prompt, tokens, timeouts)
                    yield token
                    if len(tokens) == limit:
                        return
            except _StepFailed as exc:
                failure = Failure(attempt.nodes, exc.suspects, exc.reason, len(tokens))
            finally:
                attempt.close()
            reroutes += 1
            if reroute is None or reroutes > max_reroutes:
                raise PipelineError(failure)
            new_chain = await reroute(failure)
            if new_chain is None:
                raise PipelineError(failure)
            _check_chain(new_chain)
            chain = new_chain


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


def _check_chain(chain: Sequence[Hop]) -> None:
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
