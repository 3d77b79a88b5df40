"""The hop side of the data plane: serve one shard to the entries that open sessions on it.

A hop holds one shard (layers [a, b)) of a model. An entry opens a session
on it (`open`), then sends one `forward` per step; the hop runs its shard
over the inputs with the session's KV cache and pushes the result on:
activations to the next hop, or, on the last hop, the sampled token back to
the entry. This module is what a hop does with the messages of
`runtime.inference.protocol` (`HopServer`) and what it counts (`HopStats`).
Decode steps that find the shard busy wait and run together, as one
batched forward (`runtime.inference.batcher`); a long prefill runs in
chunks, and those batches run between them.

Why the hop behaves as it does (threads, bad input, errors):
docs/design/inference-protocol.md#the-hop-server; how batches form:
docs/design/batching.md#forming-batches-at-a-hop; chunks:
docs/design/batching.md#chunked-prefill.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

import numpy as np
import trio

from mesh.identity import Signer
from mesh.newcomers import neighbourhood
from mesh.transport import Plane
from mesh.wire import MAX_ADDR_CHARS
from runtime.inference.batcher import MAX_BATCH_ROWS, BatchStats, ChunkSizer, DecodeQueue
from runtime.inference.blame import (
    Contradiction,
    Receipt,
    check_handoff,
    joined_digest,
    row_digests,
    rows_digest,
    token_digest,
)
from runtime.inference.commitment import (
    CHAIN_DIGEST_BYTES,
    DIGEST_BYTES,
    SIGN_EVERY,
    SKETCH_DIMS,
    Commitment,
    ids_digest,
    sketch,
)
from runtime.inference.kv_memory import REASON_MEMORY, KvMemory
from runtime.inference.latency import STEP_BUCKETS_S, Histogram
from runtime.inference.protocol import (
    MAX_NAME_CHARS,
    OP_BUSY,
    OP_COMMIT,
    OP_FORWARD,
    OP_OPEN,
    OP_OPENED,
    OP_SEAL,
    OP_TOKEN,
    R_BAD_FIELD,
    R_BAD_HANDOFF,
    R_BAD_PAYLOAD,
    R_BAD_POSITION,
    R_BUDGET,
    R_DUPLICATE,
    R_LEAVING,
    R_NOT_SESSION_PEER,
    R_OVERLOADED,
    R_SHARD_FAILED,
    R_UNKNOWN_SESSION,
    R_WRONG_SENT,
    R_WRONG_SHARD,
    BadMessage,
    check_field,
    compute_us_field,
    constraint_field,
    encode_message,
    error_header,
    generated_field,
    logprob_header,
    logprobs_field,
    node_field,
    refuse_open,
    sampling_from_header,
    session_field,
    text_field,
    uint_field,
)
from runtime.inference.session_policy import (
    MAX_SESSION_SHARE,
    PENDING_GRACE_S,
    Admit,
    Holder,
    SessionLimits,
    Slot,
    Standing,
)
from runtime.model.backends.base import KVCache, ShardBackend
from runtime.model.grammar import ConstraintError, Matcher, Vocabulary
from runtime.model.sampling import SEED_MODULUS, SamplingParams, sample, token_margin

T = TypeVar("T")

__all__ = [
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_MAX_BUDGET",
    "DEFAULT_MAX_SESSIONS",
    "INLINE_MAX_TOKENS",
    "MAX_SESSION_SHARE",
    "HopServer",
    "HopStats",
]

INLINE_MAX_TOKENS: Final = 1
"""Decode steps (one token) run on the event loop itself; prefills and
replays go to a worker thread. A decode step is short (well under the
profiles' timer granularity for the shards a node holds), while a thread
handoff costs ~0.5 ms per hop in GIL ping-pong on Python-heavy forwards,
measured on loopback: half of a hop's overhead. A prefill can take seconds
and would stall membership and Raft, so it never runs inline."""

_NO_ROWS: Final = np.zeros((0, SKETCH_DIMS), np.float32)
"""The first hop's input sketch: it commits its token ids by digest."""

# --- the hop server -----------------------------------------------------------

# How many sessions one shard serves at once. Each holds a KV cache of
# budget x layers x 2 x kv_heads x head_dim elements (for a 7B-class model,
# 32 layers x 8 KV heads x 128 x 2 bytes: 128 KiB per position per full
# model, so a 4,096-position session on a quarter of the layers is ~128 MiB)
# and they share one device, so more sessions mostly lengthen every step.
# 16 keeps a volunteer's memory bounded while letting a few chats interleave;
# beyond it the entry gets "busy" and routes elsewhere.
DEFAULT_MAX_SESSIONS: Final = 16

# Largest budget (positions) one session may ask for: the prompt plus the
# tokens to generate. It bounds one session's cache (see above); 8,192 covers
# ordinary chats and small models' context windows.
DEFAULT_MAX_BUDGET: Final = 8192

# A session with no message for this long is closed. Decode steps are at most
# seconds apart and the entry closes sessions itself when a request ends, so
# this only frees what a vanished entry (crash, lost close) left behind; a
# minute is long enough never to cut a live stream waiting on a slow peer or
# on a reroute elsewhere, and short enough that leaked caches do not pile up.
DEFAULT_IDLE_TIMEOUT_S: Final = 60.0
# The reaper runs every idle_timeout / REAP_FRACTION, so a session is reaped
# at most 25% after its limit.
REAP_FRACTION: Final = 4

# Room for a message's CBOR header beside its payload (session, step,
# pos, a compute_us per hop): a few hundred bytes in practice.
HEADER_ROOM_BYTES: Final = 16 * 1024

# A session that stepped on this hop within this long is live: its next step
# is due, so a step of another session goes to the batcher instead of running
# at once on the loop (HopServer._idle). A decode step comes back within a
# few hundred milliseconds on a chain fast enough for batching to matter, and
# the entry closes a session when its request ends; a second is past both,
# and a lone session is back on the fast path a second after the others end.
LIVE_S: Final = 1.0

# Steps that may wait for one session's task. The entry sends one step and
# waits for its token before the next, so an honest session never queues
# more than one; the bound only stops a misbehaving peer from queueing
# unbounded work (it gets "overloaded").
SESSION_QUEUE: Final = 4


@dataclass
class HopStats:
    """Forwards this hop has computed, and the time they took, sampling
    included on the last hop (for ``/v1/network/status``). Beside a chain's
    step latency these show where its time goes: the shards' compute, or the
    hops between them."""

    decode_steps: int = 0
    decode_compute_s: float = 0.0
    prefill_steps: int = 0
    prefill_tokens: int = 0
    prefill_compute_s: float = 0.0
    # Forwards the prefills (and replays) ran in: more than prefill_steps
    # when long ones were chunked (docs/design/batching.md#chunked-prefill).
    prefill_chunks: int = 0
    reaped: int = 0  # sessions closed by the idle reaper
    # Each forward's time, by phase (``/metrics``: shardmesh_hop_step_seconds);
    # a batch of decode steps is one forward.
    decode_step_s: Histogram = field(default_factory=lambda: Histogram(STEP_BUCKETS_S))
    prefill_step_s: Histogram = field(default_factory=lambda: Histogram(STEP_BUCKETS_S))
    batching: BatchStats = field(default_factory=BatchStats)
    kv_memory: KvMemory | None = None
    """The hop's cache budget, shown beside what it computed."""

    def count(self, tokens: int, seconds: float, rows: int = 1, chunks: int = 1) -> None:
        """One step of ``tokens`` per row took ``seconds``; ``rows`` > 1
        is a batch of decode steps, whose time is counted once (the shard
        was busy that long), its steps one each; a prefill ran in
        ``chunks`` forwards."""
        if tokens == 1:  # a decode step; more tokens are a prefill or a replay
            self.decode_steps += rows
            self.decode_compute_s += seconds
            self.decode_step_s.observe(seconds)
        else:
            self.prefill_steps += 1
            self.prefill_chunks += chunks
            self.prefill_tokens += tokens
            self.prefill_compute_s += seconds
            self.prefill_step_s.observe(seconds)

    def to_json(self) -> dict[str, Any]:
        return {
            "decode_steps": self.decode_steps,
            "decode_compute_s": round(self.decode_compute_s, 6),
            "prefill_steps": self.prefill_steps,
            "prefill_tokens": self.prefill_tokens,
            "prefill_compute_s": round(self.prefill_compute_s, 6),
            "prefill_chunks": self.prefill_chunks,
            "reaped": self.reaped,
            "step_s": {
                "decode": self.decode_step_s.to_json(),
                "prefill": self.prefill_step_s.to_json(),
            },
            "batching": self.batching.to_json(),
            **({} if self.kv_memory is None else {"kv_memory": self.kv_memory.to_json()}),
        }


@dataclass(frozen=True, slots=True)
class _Step:
    """One forward of a session's: ``inputs`` at positions ``pos`` onwards,
    towards token ``step``; ``compute_us`` is what the hops before this one
    spent on it."""

    step: int
    pos: int
    inputs: np.ndarray
    compute_us: tuple[int, ...]
    handoff: tuple[Commitment, bytes] | None = None
    """The sender's commitment for this step and its receipt's signature
    (runtime.inference.blame); None on the first hop (the entry sent it)."""


@dataclass(frozen=True, slots=True)
class _Result:
    """What a step produced: activations for the next hop (``hidden``) or
    the last hop's ``token``; its compute time, its signed commitment, and
    a spot check's token verdicts (``picks``, ``margins``) when it is one."""

    hidden: np.ndarray | None
    token: int | None
    took_us: int
    commitment: Commitment | None
    checked: dict[str, list[Any]]
    refusal: Contradiction | str | None = None
    """Set when the step was not computed: what arrived disagrees with the
    sender's commitment (proof against it, or text when nothing is provable)."""


def _refused(refusal: Contradiction | str) -> _Result:
    return _Result(None, None, 0, None, {}, refusal)


@dataclass(eq=False)
class _Session:
    """One conversation's state on this hop."""

    id: str
    entry: bytes  # the node that opened the session: replies go only to it
    holder: Holder  # the entry as the session policy sees it
    reply: str  # the entry's data address
    prev: bytes  # the only node whose forwards this session takes
    next_node: bytes | None
    next_addr: str | None
    next_session: str | None
    budget: int
    sampling: SamplingParams | None
    seed: int
    sketch_seed: int  # the projection this hop's commitments use (runtime.inference.commitment)
    # A spot check's replay (last hop only): the position of the first
    # generated token's logits, and the tokens the checked run claimed.
    check: tuple[int, tuple[int, ...]] | None
    cache: KVCache
    opened_at: float
    last_used: float
    graced: bool  # see runtime.inference.session_policy.Admit
    # Set by the first forward: until then the session is pending and the
    # first to give way when the hop is full (runtime.inference.session_policy).
    started: bool = False
    # Position the next forward must start at, counting steps already queued.
    next_pos: int = 0
    # Steps handed to the session's task and not finished: while any are,
    # a new step must queue behind them, never run ahead in the receive loop,
    # and the session is not idle (a long prefill on slow hardware, or steps
    # waiting for a busy shard, are never reaped).
    queued: int = 0
    # The session's latest commitment (the head of its hash chain), and how
    # many were made since the last signed one.
    last: Commitment | None = None
    unsigned: int = 0
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    inbox: trio.MemorySendChannel[_Step] | None = None
    # Last hop only: the logprobs the entry asked for (protocol.logprobs_field).
    logprobs: tuple[int, tuple[int, ...]] | None = None
    # Last hop only: every token generated so far, those before this session
    # (protocol.generated_field) and those it sampled; the penalties' and the
    # constraint's input. `matcher` is the constraint's state after them.
    generated: list[int] = field(default_factory=list)
    matcher: Matcher | None = None


@dataclass(eq=False)
class _Row:
    """A decode step waiting for the batcher, and what came of it: its
    result, or the error that failed it; ``done`` once either is set."""

    session: _Session
    work: _Step
    done: trio.Event = field(default_factory=trio.Event)
    result: _Result | None = None
    error: Exception | None = None


class HopServer:
    """Serves one shard to entries over the data plane.

    Create it on the trio thread, start :meth:`run` in a nursery
    (``await nursery.start(server.run)``), then feed it hop messages through
    :meth:`handle` (the :class:`runtime.inference.dispatch.Engine` receive loop does).
    """

    def __init__(
        self,
        plane: Plane,
        shard: ShardBackend,
        *,
        model: str,
        drops: Counter[str],
        signer: Signer,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_budget: int = DEFAULT_MAX_BUDGET,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        pending_grace_s: float = PENDING_GRACE_S,
        tokenizer_dir: Path | None = None,
        kv_memory: KvMemory | None = None,
    ) -> None:
        if max_sessions < 1 or max_budget < 1 or idle_timeout_s <= 0 or pending_grace_s <= 0:
            raise ValueError(
                "max_sessions, max_budget, idle_timeout_s and pending_grace_s must be positive"
            )
        self.plane = plane
        self.shard = shard
        self.model = model
        self.signer = signer
        self.max_sessions = max_sessions
        self.max_budget = max_budget
        # The model's tokenizer, for constraints (runtime.model.grammar):
        # read on the first constrained session, then kept.
        self.tokenizer_dir = tokenizer_dir
        self._vocabulary: Vocabulary | None = None
        self._vocabulary_lock = threading.Lock()
        self.idle_timeout_s = idle_timeout_s
        self.kv_memory = kv_memory
        """The caches' budget (`runtime.inference.kv_memory`; None: bounded
        by the session count alone)."""
        self.stats = HopStats(kv_memory=kv_memory)
        self.limits = SessionLimits(max_sessions, pending_grace_s)
        self.standing = Standing()
        """Entries that completed a session here: preferred when the hop is full."""
        self._drops = drops
        self._sessions: dict[str, _Session] = {}
        # One forward at a time on this shard's device (see the module docstring).
        self._compute = trio.CapacityLimiter(1)
        # One prefill (or replay, or spot check's step) at a time takes its
        # turn at the shard: the batcher waits behind at most one of their
        # forwards, however many prompts arrive at once (the limiter is
        # first come, first served, so with one turn each, 15 prompts put 15
        # chunks ahead of every decode batch).
        self._prefill_turn = trio.CapacityLimiter(1)
        # Decode steps waiting for the busy shard, and the batcher's wake-up.
        self._decodes: DecodeQueue[str, _Row] = DecodeQueue()
        self._wake = trio.Event()
        self.chunks = ChunkSizer()
        """How long the next chunk of a prefill is (the batches' and the
        chunks' forward times, measured)."""
        self._nursery: trio.Nursery | None = None
        self.leaving = False
        """Set when the node is stopping: new sessions are refused (`busy`),
        so entries route around it (see `runtime.node.drain`)."""

    @property
    def max_message_bytes(self) -> int:
        """The largest message a session of this hop can need: a whole
        budget of inputs (token ids into the first hop, hidden states into
        the others) plus its header. The engine refuses bigger ones."""
        shard = self.shard
        # Past the first hop each position also brings the sender's two
        # sketches (its commitment, in the handoff).
        row = 8 if shard.is_first else 4 * shard.hidden_size + 8 * SKETCH_DIMS
        return self.max_budget * row + HEADER_ROOM_BYTES

    @property
    def sessions(self) -> int:
        """Open sessions (for ``/v1/network/status``)."""
        return len(self._sessions)

    def bulk_allowance(self, peer: bytes) -> int:
        """The largest message node ``peer`` may send this hop now: a whole
        budget of inputs while it is the node some open session takes its
        forwards from (its prefill may be chunked), else 0: a stranger's
        messages stay within one chunk (`mesh.transport.Plane.allow_bulk`).
        A scan of at most ``max_sessions``, asked once per big message."""
        if any(session.prev == peer for session in self._sessions.values()):
            return self.max_message_bytes
        return 0

    async def on_shard(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` in a worker thread, never at the same time as a
        session's forward: the node's capability re-check runs its probe on
        the shard this server holds, and backends are not thread-safe."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self._compute)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host the session tasks and the batcher, and reap idle sessions,
        until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._batch_forever, name="hop.batcher")
            task_status.started()
            try:
                while True:
                    await trio.sleep(self.idle_timeout_s / REAP_FRACTION)
                    self._reap(trio.current_time())
            finally:
                self._nursery = None
                for session in list(self._sessions.values()):
                    self._close(session)

    def handle(
        self,
        peer: bytes,
        op: str,
        header: Mapping[str, Any],
        dtype: str,
        shape: tuple[int, ...],
        raw: Any,
        *,
        source: str | None = None,
    ) -> None:
        """Act on one hop message (``open``, ``forward`` or ``close``) from
        node ``peer``, which sent it from IP address ``source`` (None: the
        node itself). Never raises for bad input: refusals are counted and
        answered if possible; a message from a peer the session is not
        bound to is only counted (it must not be able to end the session)."""
        session: _Session | None = None
        try:
            if op == OP_OPEN:
                self._open(peer, header, source)
                return
            found = self._sessions.get(session_field(header))
            if found is None:
                if op == OP_FORWARD:
                    raise BadMessage(R_UNKNOWN_SESSION)
                return  # close is idempotent
            if peer != (found.prev if op == OP_FORWARD else found.entry):
                raise BadMessage(R_NOT_SESSION_PEER)
            if op == OP_FORWARD:
                session = found
                self._forward(session, header, dtype, shape, raw)
            else:
                if found.last is not None:  # a session this hop served: standing
                    self.standing.earn(found.entry)
                self._seal(found)
                self._close(found)
        except BadMessage as exc:
            self._drops[f"engine.{exc.reason}"] += 1
            if session is not None:
                self._fail(session, header.get("step"), exc.reason, exc.detail)

    # --- open / close -------------------------------------------------------

    def _open(self, entry: bytes, header: Mapping[str, Any], source: str | None) -> None:
        reply = text_field(header, "reply", MAX_ADDR_CHARS)
        session_id = session_field(header)
        now = trio.current_time()
        holder = self._holder(entry, source)
        decision = self.limits.decide(holder, self._slots(), now, leaving=self.leaving)
        if not isinstance(decision, Admit):
            self._drops["engine.busy"] += 1
            self._send(
                reply, entry, {"op": OP_BUSY, "session": session_id, "reason": decision.reason}
            )
            return
        try:
            session = self._new_session(session_id, holder, reply, header, now, decision.graced)
        except BadMessage as exc:
            refuse_open(self.plane, entry, header, exc.reason, exc.detail)
            raise
        if self.kv_memory is not None and not self.kv_memory.reserve(session_id, session.budget):
            self._drops["engine.busy_memory"] += 1
            self._send(
                reply, entry, {"op": OP_BUSY, "session": session_id, "reason": REASON_MEMORY}
            )
            return
        if decision.displace is not None:  # only once the open is known good
            self._displace(self._sessions[decision.displace], decision.why)
        # The engine starts run() before it reads the plane, and both end together.
        assert self._nursery is not None, "HopServer.run is not running"
        send, receive = trio.open_memory_channel[_Step](SESSION_QUEUE)
        session.inbox = send
        self._sessions[session_id] = session
        self._nursery.start_soon(self._serve, session, receive, name=f"hop.session.{session_id}")
        self._send(reply, entry, {"op": OP_OPENED, "session": session_id})

    def _holder(self, entry: bytes, source: str | None) -> Holder:
        """``entry`` as the session policy sees it: its network, and whether
        it has standing (the node itself always has)."""
        if entry == self.signer.node_id:
            return Holder(entry, None, True)
        prefix = None if source is None else neighbourhood(source)[1]
        return Holder(entry, prefix, entry in self.standing)

    def _slots(self) -> list[Slot]:
        return [
            Slot(s.id, s.holder, s.opened_at, s.started, s.last_used, s.graced)
            for s in self._sessions.values()
        ]

    def _displace(self, session: _Session, why: str) -> None:
        """End ``session`` for a newcomer the policy prefers: its entry gets
        ``busy`` (a reason to route around this hop, as at open); a session
        that never forwarded costs its entry its standing."""
        self._drops["engine.displaced"] += 1
        if not session.started:
            self.standing.lose(session.entry)
        self._send(
            session.reply, session.entry, {"op": OP_BUSY, "session": session.id, "reason": why}
        )
        self._close(session)

    def _new_session(
        self,
        session_id: str,
        holder: Holder,
        reply: str,
        header: Mapping[str, Any],
        now: float,
        graced: bool,
    ) -> _Session:
        """Validate an ``open`` against what this hop serves."""
        entry = holder.peer
        if session_id in self._sessions:
            raise BadMessage(R_DUPLICATE)
        model = text_field(header, "model", MAX_NAME_CHARS)
        layers = header.get("layers")
        spec = self.shard.spec
        if model != self.model or layers != [spec.start, spec.end]:
            raise BadMessage(
                R_WRONG_SHARD, f"this hop serves {self.model} layers [{spec.start}, {spec.end})"
            )
        budget = uint_field(header, "budget")
        if not 0 < budget <= self.max_budget:
            raise BadMessage(R_BUDGET, f"budget must be in 1..{self.max_budget}")
        seed = uint_field(header, "seed", high=SEED_MODULUS - 1)
        sketch_seed = uint_field(header, "sketch_seed", high=SEED_MODULUS - 1)
        check = check_field(header, budget)
        if check is not None and not self.shard.is_last:
            raise BadMessage(R_BAD_FIELD, "only the last hop checks tokens")
        logprobs = logprobs_field(header, budget)
        if logprobs is not None and not self.shard.is_last:
            raise BadMessage(R_BAD_FIELD, "only the last hop computes logprobs")
        prev = node_field(header, "prev")
        if self.shard.is_first and prev != entry:
            raise BadMessage(R_BAD_FIELD, "the first hop takes its inputs from the entry")
        next_node: bytes | None
        if self.shard.is_last:
            nexts = (header.get(name) for name in ("next", "next_node", "next_session"))
            if any(value is not None for value in nexts):
                raise BadMessage(R_BAD_FIELD, "the last hop has no next hop")
            next_addr = next_session = next_node = None
            constraint = constraint_field(header)
            if constraint is not None and self.tokenizer_dir is None:
                raise BadMessage(R_BAD_FIELD, "this hop has no tokenizer to apply a constraint")
            sampling: SamplingParams | None = sampling_from_header(
                header.get("sampling"), constraint
            )
            generated = list(generated_field(header, budget))
        else:
            next_addr = text_field(header, "next", MAX_ADDR_CHARS)
            next_node = node_field(header, "next_node")
            next_session = session_field(header, "next_session")
            sampling, generated = None, []
        return _Session(
            id=session_id,
            entry=entry,
            holder=holder,
            reply=reply,
            prev=prev,
            next_node=next_node,
            next_addr=next_addr,
            next_session=next_session,
            budget=budget,
            sampling=sampling,
            seed=seed,
            sketch_seed=sketch_seed,
            check=check,
            cache=self.shard.new_cache(),
            opened_at=now,
            last_used=now,
            graced=graced,
            logprobs=logprobs,
            generated=generated,
        )

    def _close(self, session: _Session) -> None:
        if self._sessions.get(session.id) is session:
            del self._sessions[session.id]
            if self.kv_memory is not None:
                self.kv_memory.release(session.id)
        session.scope.cancel()
        if session.inbox is not None:
            session.inbox.close()

    def _seal(self, session: _Session) -> None:
        """The entry closed the session: sign its last commitment, if that
        one is not signed yet, so every commitment of it is proven."""
        last = session.last
        if last is None or last.signature:
            return
        signature = last.signed(self.signer).signature
        header = {"op": OP_SEAL, "session": session.id, "step": last.step, "sig": signature}
        self._send(session.reply, session.entry, header)

    def _reap(self, now: float) -> None:
        for session in list(self._sessions.values()):
            if not session.queued and now - session.last_used >= self.idle_timeout_s:
                self.stats.reaped += 1
                if not session.started:  # held a slot and never used it
                    self.standing.lose(session.entry)
                self._close(session)

    # --- steps --------------------------------------------------------------

    def _forward(
        self,
        session: _Session,
        header: Mapping[str, Any],
        dtype: str,
        shape: tuple[int, ...],
        raw: Any,
    ) -> None:
        """Validate a step and queue it for the session's task."""
        step = uint_field(header, "step")
        pos = uint_field(header, "pos")
        compute_us = compute_us_field(header)
        shard = self.shard
        if shard.is_first:
            ok = dtype == "int64" and len(shape) == 1
        else:
            ok = dtype == "float32" and len(shape) == 2 and shape[1] == shard.hidden_size
        if not ok or shape[0] == 0:
            want = "int64 [T]" if shard.is_first else f"float32 [T, {shard.hidden_size}]"
            raise BadMessage(R_BAD_PAYLOAD, f"want {want}, got {dtype} {list(shape)}")
        if pos != session.next_pos:
            raise BadMessage(R_BAD_POSITION, f"expected pos {session.next_pos}, got {pos}")
        if pos + shape[0] > session.budget:
            raise BadMessage(R_BUDGET, f"budget of {session.budget} positions exceeded")
        handoff = None
        if not shard.is_first:  # rows nobody signed are not taken
            handoff = _handoff(session, self.model, header, step, pos, shape[0])
        session.started = True
        # A copy: the frame's bytes are read-only and torch refuses to wrap
        # read-only memory without a warning. One activation row per decode step.
        inputs = np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
        work = _Step(step, pos, inputs, compute_us, handoff)
        if shape[0] <= INLINE_MAX_TOKENS and not session.queued and self._idle(session):
            # Nothing is ahead of it, and no other session's step is due.
            session.next_pos = pos + shape[0]
            self._run_now(session, work)
            return
        assert session.inbox is not None
        try:
            session.inbox.send_nowait(work)
        except trio.WouldBlock:
            raise BadMessage(R_OVERLOADED, "too many steps queued for this session") from None
        session.next_pos = pos + shape[0]
        session.queued += 1
        session.last_used = trio.current_time()

    def _idle(self, session: _Session) -> bool:
        """Whether a step of ``session`` may run at once, on the loop: the
        shard is free, no decode step waits for it (a step that arrives
        while others wait joins their batch), and no other session stepped
        here within ``LIVE_S``. Under load, every decode step goes to the
        batcher, whose forwards run in a worker thread: a step run on the
        loop would hold it, the others' steps would arrive only after, find
        the shard free and run alone too, and no batch would ever form."""
        return bool(self._compute.available_tokens) and not self._decoding(session)

    def _decoding(self, session: _Session) -> bool:
        """Whether decode steps of sessions other than ``session`` are due:
        some wait for the shard, or another session stepped here within
        ``LIVE_S``. A prefill of ``session`` then runs in chunks that take
        about one of their batches' time each."""
        if self._decodes:
            return True
        horizon = trio.current_time() - LIVE_S
        return any(
            other.started and other.last_used > horizon and other is not session
            for other in self._sessions.values()
        )

    async def _serve(
        self,
        session: _Session,
        inbox: trio.MemoryReceiveChannel[_Step],
    ) -> None:
        """The session's task: run its queued steps in order (see
        :meth:`_forward` for the steps that never queue)."""
        with session.scope:
            try:
                async for work in inbox:
                    try:
                        result = await self._queued_step(session, work)
                    except Exception as exc:  # a failing shard must not take the server down
                        self._shard_failed(session, work.step, exc)
                        return
                    finally:
                        session.queued -= 1
                    if self._sessions.get(session.id) is not session:
                        return  # closed while its step ran in a batch: nobody waits for it
                    self._push(session, work, result)
            finally:
                self._close(session)

    async def _queued_step(self, session: _Session, work: _Step) -> _Result:
        """Run a step that waited: a decode step in the batcher's next batch;
        a prefill, a replay or a spot check's step alone, in its turn (one
        such step at a time: `_prefill_turn`), a prefill in a worker
        thread, in chunks when it is long."""
        tokens = work.inputs.shape[0]
        if tokens == 1 and session.check is None:
            return await self._in_batch(session, work)
        async with self._prefill_turn:
            return await self._solo_step(session, work)

    async def _solo_step(self, session: _Session, work: _Step) -> _Result:
        """A step that does not batch, in its prefill turn (see `_queued_step`)."""
        tokens = work.inputs.shape[0]
        if tokens <= INLINE_MAX_TOKENS:
            async with self._compute:
                return self._compute_step(session, work)
        if self.chunks.next(tokens, decoding=self._decoding(session)) < tokens:
            return await self._chunked(session, work)
        return await trio.to_thread.run_sync(
            self._compute_step, session, work, limiter=self._compute
        )

    async def _chunked(self, session: _Session, work: _Step) -> _Result:
        """A long prefill (or replay) in chunks, each a forward of its own
        that takes the shard alone: between two chunks the shard goes to
        the batcher if decode steps wait for it (the limiter wakes waiters
        in order), so they wait for one chunk, not the whole prompt. The
        cache grows chunk by chunk; the result is what one forward would
        have given (every position's output, sampled, committed) and its
        time is the session's, from the first chunk to the last, yields
        included, as a batch's rows report the batch's."""
        received, refusal = await trio.to_thread.run_sync(_received, work)
        if refusal is not None:
            return _refused(refusal)
        tokens = work.inputs.shape[0]
        outputs: list[np.ndarray] = []
        spent: list[float] = []  # each chunk's forward time
        began, start = time.perf_counter(), 0
        while True:
            stop = start + self.chunks.next(tokens - start, decoding=self._decoding(session))
            if stop == tokens:
                break
            output = await trio.to_thread.run_sync(
                self._compute_chunk, session, work, start, stop, spent, limiter=self._compute
            )
            outputs.append(output)
            start = stop
        finish = (session, work, received, outputs, spent, start, began)
        return await trio.to_thread.run_sync(self._last_chunk, *finish, limiter=self._compute)

    def _compute_chunk(
        self, session: _Session, work: _Step, start: int, stop: int, spent: list[float]
    ) -> np.ndarray:
        """The shard's forward over positions [start, stop) of ``work``'s;
        its time goes to ``spent`` and to the chunk sizer."""
        began = time.perf_counter()
        positions = _positions(work)[start:stop]
        output = self.shard.forward(work.inputs[start:stop], positions, session.cache)
        took = time.perf_counter() - began
        self.chunks.chunked(stop - start, took)
        spent.append(took)
        return output

    def _last_chunk(
        self,
        session: _Session,
        work: _Step,
        received: bytes,
        outputs: list[np.ndarray],
        spent: list[float],
        start: int,
        began: float,
    ) -> _Result:
        """The last chunk, then the step's result from every chunk's output
        (as `_compute_step` makes it from one forward's). The stats count
        the chunks' compute; the session is told the time it waited."""
        tokens = work.inputs.shape[0]
        last = time.perf_counter()
        outputs.append(self._compute_chunk(session, work, start, tokens, spent))
        output = np.concatenate(outputs)
        token = self._sampled(session, output, work.step)
        done = time.perf_counter()
        compute = math.fsum(spent[:-1]) + done - last  # the last chunk's sampling included
        self.stats.count(tokens, compute, chunks=len(outputs))
        took = done - began
        return self._committed(session, work, received, output, token, took)

    async def _in_batch(self, session: _Session, work: _Step) -> _Result:
        """Wait for the batcher to run ``work`` in a batch; its result, or
        the error that failed it. A session closed meanwhile leaves the
        queue (a batch already running computes its row, unsent)."""
        row = _Row(session, work)
        self._decodes.add(session.id, row, trio.current_time())
        self._wake.set()
        try:
            await row.done.wait()
        finally:
            if not row.done.is_set():
                self._decodes.discard(row)
        if row.error is not None:
            raise row.error
        assert row.result is not None
        return row.result

    async def _batch_forever(self) -> None:
        """The batcher: whenever decode steps wait, run them in batches."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            while self._decodes:
                await self._run_batch()

    async def _run_batch(self) -> None:
        """Take the shard, then the waiting steps (those that arrived while
        it was busy included), and run them as one forward in a worker
        thread, even one alone: the loop keeps receiving meanwhile, and the
        steps that arrive make the next batch (see :meth:`_idle`)."""
        async with self._compute:
            rows, waits = self._decodes.take(MAX_BATCH_ROWS, trio.current_time())
            if not rows:
                return  # their sessions left while the shard was busy
            self.stats.batching.count(waits)
            await trio.to_thread.run_sync(self._compute_rows, rows)
        for row in rows:
            row.done.set()

    def _run_now(self, session: _Session, work: _Step) -> None:
        """Run a decode step right here in the receive loop, as the session's
        task would, minus the hand-off: the step runs on the event loop
        either way (``INLINE_MAX_TOKENS``), and skipping the queue and the
        limiter's checkpoint saves two scheduler rounds per hop, which is
        most of what a hop's Python costs beyond the forward itself."""
        self._compute.acquire_nowait()
        try:
            result = self._compute_step(session, work)
        except Exception as exc:  # a failing shard must not take the server down
            self._shard_failed(session, work.step, exc)
            return
        finally:
            self._compute.release()
        self._push(session, work, result)

    def _push(self, session: _Session, work: _Step, result: _Result) -> None:
        """Send a step's result on: the token to the entry (its commitment
        in the same message), or the activations to the next hop and then
        this hop's commitment to the entry; this hop's time appended."""
        session.last_used = trio.current_time()
        if result.refusal is not None:
            self._refuse(session, work.step, result.refusal)
            return
        compute_us = [*work.compute_us, result.took_us]
        commitment = result.commitment
        assert commitment is not None
        if result.token is not None:
            # What it emits, signed beside what it committed: the entry
            # emits no token its receipt does not cover (runtime.inference.blame).
            receipt = Receipt.of(commitment, token_digest(result.token)).signed(self.signer)
            header = {
                "op": OP_TOKEN,
                "session": session.id,
                "token": result.token,
                "ctoken": commitment.token,
                "receipt": receipt.signature,
                "compute_us": compute_us,
                **commitment.header_fields(),
                **_relay(work),
                **result.checked,
            }
            self.plane.send(
                session.reply,
                encode_message(header, commitment.payload()),
                peer=session.entry,
            )
            return
        assert session.next_addr is not None and session.next_node is not None
        assert result.hidden is not None
        receipt = Receipt.of(commitment, rows_digest(result.hidden)).signed(self.signer)
        header = {
            "op": OP_FORWARD,
            "session": session.next_session,
            "step": work.step,
            "pos": work.pos,
            "compute_us": compute_us,
            "handoff": _handoff_header(commitment, receipt.signature),
        }
        self.plane.send(
            session.next_addr, encode_message(header, result.hidden), peer=session.next_node
        )
        commit = {
            "op": OP_COMMIT,
            "session": session.id,
            **commitment.header_fields(),
            **_relay(work),
        }
        self.plane.send(
            session.reply, encode_message(commit, commitment.payload()), peer=session.entry
        )

    def _refuse(self, session: _Session, step: int, refusal: Contradiction | str) -> None:
        """What arrived disagrees with the sender's commitment: end the
        session, telling the entry why; with the proof when there is one, so
        the entry blames the sender, not this hop."""
        if isinstance(refusal, str):
            self._drops[f"engine.{R_BAD_HANDOFF}"] += 1
            self._fail(session, step, R_BAD_HANDOFF, refusal)
            return
        self._drops[f"engine.{R_WRONG_SENT}"] += 1
        header = error_header(session.id, step, R_WRONG_SENT, refusal.fault())
        self._send(session.reply, session.entry, {**header, "proof": refusal.to_json()})
        self._close(session)

    def _shard_failed(self, session: _Session, step: int, exc: Exception) -> None:
        self._drops[f"engine.{R_SHARD_FAILED}"] += 1
        self._fail(session, step, R_SHARD_FAILED, f"{type(exc).__name__}: {exc}")

    def _compute_step(self, session: _Session, work: _Step) -> _Result:
        """The shard's forward, on the last hop the sampled token, and the
        signed commitment to both (runtime.inference.commitment); with the
        microseconds the forward took (the commitment is not counted: the
        entry wants the compute's cost, and the benchmark measures the
        commitment's separately)."""
        received, refusal = _received(work)
        if refusal is not None:
            return _refused(refusal)
        tokens = work.inputs.shape[0]
        began = time.perf_counter()
        output = self.shard.forward(work.inputs, _positions(work), session.cache)
        token = self._sampled(session, output, work.step)
        took = time.perf_counter() - began
        # Only one forward runs at a time (the compute limiter), so this is
        # the stats' (and the chunk sizer's) only writer even when it runs
        # in a worker thread.
        self.stats.count(tokens, took)
        if tokens == 1:
            self.chunks.decoded(took)
        return self._committed(session, work, received, output, token, took)

    def _compute_rows(self, rows: list[_Row]) -> None:
        """Run a batch's decode steps, setting each row's result or error: a
        row whose handoff is refused leaves the batch (refused alone), the
        others go through the shard as one forward; then each samples and
        commits on its own, and a row that fails there fails alone. Every
        row reports the batch's time as its compute: the step took that
        long for each of them."""
        if len(rows) == 1:
            row = rows[0]
            row.result = _attempt(row, self._compute_step, row.session, row.work)
            return
        accepted: list[tuple[_Row, bytes]] = []
        for row in rows:
            received, refusal = _attempt(row, _received, row.work) or (b"", None)
            if refusal is not None:
                row.result = _refused(refusal)
            elif row.error is None:
                accepted.append((row, received))
        if not accepted:
            return
        steps = [(r.work.inputs, _positions(r.work), r.session.cache) for r, _ in accepted]
        began = time.perf_counter()
        try:
            outputs = self.shard.forward_batch(steps)
        except Exception as exc:  # one forward: every row of it failed
            for row, _ in accepted:
                row.error = exc
            return
        tokens = [
            _attempt(row, self._sampled, row.session, output, row.work.step)
            for (row, _), output in zip(accepted, outputs, strict=True)
        ]
        took = time.perf_counter() - began
        self.stats.count(1, took, rows=len(accepted))
        self.chunks.decoded(took)
        for (row, received), output, token in zip(accepted, outputs, tokens, strict=True):
            if row.error is None:
                args = (row.session, row.work, received, output, token, took)
                row.result = _attempt(row, self._committed, *args)

    def _sampled(self, session: _Session, output: np.ndarray, step: int) -> int | None:
        """The last hop's token for ``step`` from its logits; None elsewhere."""
        if session.sampling is None:
            return None
        return self._sample(session, output[-1], step)

    def _committed(
        self,
        session: _Session,
        work: _Step,
        received: bytes,
        output: np.ndarray,
        token: int | None,
        took: float,
    ) -> _Result:
        """A computed step's result: its output (activations, or the token
        and a spot check's verdicts) and this hop's commitment to it, the
        next link of the session's hash chain, signed where it must be."""
        tokens = work.inputs.shape[0]
        checked: dict[str, list[Any]] = {}
        if session.check is not None:
            checked, judged = self._check_tokens(session, work.pos, output)
            committed_out = sketch(output[judged], session.sketch_seed)
        elif token is not None:
            committed_out = sketch(output[-1:], session.sketch_seed)
            if session.logprobs is not None:  # unsigned: what the entry asked, not a claim
                checked = logprob_header(session.logprobs, work.pos, output, token)
        else:
            committed_out = sketch(output, session.sketch_seed)
        shard = self.shard
        first = shard.is_first
        commitment = Commitment(
            hop=self.signer.node_id,
            entry=session.entry,
            session=session.id,
            model=self.model,
            layers=(shard.spec.start, shard.spec.end),
            sketch_seed=session.sketch_seed,
            step=work.step,
            pos=work.pos,
            count=tokens,
            inputs_digest=ids_digest(work.inputs) if first else received,
            inputs=_NO_ROWS if first else sketch(work.inputs, session.sketch_seed),
            outputs=committed_out,
            token=token,
            previous=b"" if session.last is None else session.last.digest(),
        )
        # The chain's first link and every SIGN_EVERY-th are signed; the
        # last is signed when the entry closes the session (`_seal`).
        session.unsigned = (session.unsigned + 1) % SIGN_EVERY
        if session.last is None or session.unsigned == 0:
            commitment = commitment.signed(self.signer)
        session.last = commitment
        hidden = None if token is not None else output
        return _Result(hidden, token, round(took * 1e6), commitment, checked)

    def vocabulary(self) -> Vocabulary:
        """The model's tokenizer as the grammar engine reads it, built once."""
        assert self.tokenizer_dir is not None  # _open refuses constraints without one
        with self._vocabulary_lock:
            if self._vocabulary is None:
                self._vocabulary = Vocabulary(self.tokenizer_dir)
            return self._vocabulary

    def _sample(self, session: _Session, logits: np.ndarray, step: int) -> int:
        """The last hop's token for ``step``: penalized over the tokens
        generated before it and masked by the session's constraint, which
        then takes the token."""
        assert session.sampling is not None
        params = session.sampling
        history = session.generated  # the entry sends it only where it matters
        constraint = params.constraint
        penalized = params.presence_penalty != 0 or params.frequency_penalty != 0
        if (constraint is not None or penalized) and len(history) != step:
            raise ValueError(f"step {step} after {len(history)} generated tokens")
        allowed = None
        if constraint is not None:
            if session.matcher is None:
                session.matcher = Matcher.after(self.vocabulary(), constraint, history)
            allowed = session.matcher.allowed(logits.shape[0])
        seed = session.seed
        token = sample(logits, params, seed=seed, step=step, history=history, allowed=allowed)
        if session.matcher is not None and token != self.vocabulary().eos:
            session.matcher.advance(token)
        history.append(token)
        return token

    def _check_tokens(
        self, session: _Session, pos: int, logits: np.ndarray
    ) -> tuple[dict[str, list[Any]], slice]:
        """A spot check's replay: for every position whose logits produced a
        claimed token, what this hop would emit there (``picks``) and how far
        the claim is from it (``margins``, see
        :func:`runtime.model.sampling.token_margin`); and the rows judged."""
        assert session.check is not None and session.sampling is not None
        first, claimed = session.check
        start = max(first - pos, 0)
        stop = min(first + len(claimed) - pos, logits.shape[0])
        picks: list[Any] = []
        margins: list[Any] = []
        params, seed = session.sampling, session.seed
        masks = self._replayed_masks(session, start, stop, pos, logits.shape[1])
        for row, allowed in zip(range(start, stop), masks, strict=True):
            step = pos + row - first
            history = claimed[:step]
            pick = sample(
                logits[row], params, seed=seed, step=step, history=history, allowed=allowed
            )
            picks.append(pick)
            margin = token_margin(
                logits[row], params, claimed[step], seed=seed, step=step, history=history,
                allowed=allowed,
            )  # fmt: skip
            margins.append(margin)
        return {"picks": picks, "margins": margins}, slice(start, max(start, stop))

    def _replayed_masks(
        self, session: _Session, start: int, stop: int, pos: int, size: int
    ) -> list[np.ndarray | None]:
        """The constraint's mask at each judged row of a spot check, from a
        matcher fed the claimed tokens before it (None without a constraint,
        and past a claimed token the grammar refuses: that row's margin is
        already infinite)."""
        assert session.check is not None and session.sampling is not None
        first, claimed = session.check
        constraint = session.sampling.constraint
        if constraint is None:
            return [None] * max(stop - start, 0)
        vocabulary = self.vocabulary()
        matcher: Matcher | None = Matcher.after(
            vocabulary, constraint, claimed[: pos + start - first]
        )
        masks: list[np.ndarray | None] = []
        for row in range(start, stop):
            masks.append(None if matcher is None else matcher.allowed(size))
            token = claimed[pos + row - first]
            if matcher is not None and token != vocabulary.eos:
                try:
                    matcher.advance(token)
                except ConstraintError:
                    matcher = None
        return masks

    def hand_over(self) -> int:
        """End every open session with an ``error`` naming this node as
        leaving: each entry re-routes around it and replays on another
        chain, which the client never sees (failover). How many ended."""
        sessions = list(self._sessions.values())
        for session in sessions:
            self._fail(session, None, R_LEAVING, "the node is stopping; route around it")
        return len(sessions)

    def _fail(self, session: _Session, step: object, reason: str, detail: str) -> None:
        """Tell the entry this session failed, and end it."""
        self._send(session.reply, session.entry, error_header(session.id, step, reason, detail))
        self._close(session)

    def _send(self, addr: str, peer: bytes, header: Mapping[str, Any]) -> None:
        self.plane.send(addr, encode_message(header), peer=peer)


# --- a step's parts -------------------------------------------------------------


def _positions(work: _Step) -> np.ndarray:
    return np.arange(work.pos, work.pos + work.inputs.shape[0], dtype=np.int64)


def _received(work: _Step) -> tuple[bytes, Contradiction | str | None]:
    """What this hop signs it received (the sender's rows' digest; nothing
    on the first hop), or why the rows are refused: they disagree with the
    sender's commitment (runtime.inference.blame.check_handoff)."""
    if work.handoff is None:
        return b"", None
    sender, signature = work.handoff
    digests = row_digests(work.inputs)
    refusal = check_handoff(sender, signature, work.inputs, digests)
    return (b"", refusal) if refusal is not None else (joined_digest(digests), None)


def _attempt(row: _Row, part: Callable[..., T], *args: Any) -> T | None:
    """``part(*args)``, one row's part of a batch; an exception fails that
    row alone (its ``error``), and gives None."""
    try:
        return part(*args)
    except Exception as exc:
        row.error = exc
        return None


# --- handoffs: the sender's commitment and receipt, riding on its forward -----


def _handoff_header(commitment: Commitment, receipt: bytes) -> dict[str, Any]:
    """What a forward carries for the next hop to check the rows against
    (runtime.inference.blame.check_handoff): the sender's commitment for
    the step, whole (the step and position are the forward's own), and its
    receipt's signature."""
    fields = commitment.header_fields()
    return {
        "session": commitment.session,
        "layers": list(commitment.layers),
        "seed": commitment.sketch_seed,
        "count": fields["count"],
        "in_rows": fields["in_rows"],
        "in_digest": fields["in_digest"],
        "prev": fields["prev"],
        "sig": fields["sig"],
        "sketches": np.ascontiguousarray(commitment.payload(), dtype="<f4").tobytes(),
        "receipt": receipt,
    }


def _relay(work: _Step) -> dict[str, Any]:
    """What a hop tells the entry of the handoff it took the step on: the
    digest of the sender's commitment as it came, and the sender's receipt
    (`runtime.inference.blame.find_equivocation`); nothing on the first hop."""
    if work.handoff is None:
        return {}
    sender, receipt = work.handoff
    return {"from_digest": sender.digest(), "from_receipt": receipt}


def _handoff(
    session: _Session, model: str, header: Mapping[str, Any], step: int, pos: int, rows: int
) -> tuple[Commitment, bytes]:
    """The sender's commitment and receipt signature from a forward's
    ``handoff``; BadMessage (``bad_handoff``) when it is missing or malformed:
    rows nobody signed are not taken."""
    value = header.get("handoff")
    if not isinstance(value, dict):
        raise BadMessage(R_BAD_HANDOFF, "a forward needs its sender's handoff")
    try:
        layers = value["layers"]
        in_rows, count = uint_field(value, "in_rows"), uint_field(value, "count")
        sketches = value["sketches"]
        receipt, signature = value["receipt"], value["sig"]
        digest, previous = value["in_digest"], value["prev"]
        ok = (
            isinstance(layers, list)
            and len(layers) == 2
            and all(type(v) is int for v in layers)
            and count == rows
            and in_rows in (0, count)
            and type(sketches) is bytes
            and len(sketches) == 4 * SKETCH_DIMS * (in_rows + count)
            and type(receipt) is bytes
            and type(signature) is bytes
            and type(digest) is bytes
            and len(digest) in (0, DIGEST_BYTES)
            and type(previous) is bytes
            and len(previous) in (0, CHAIN_DIGEST_BYTES)
        )
        if not ok:
            raise BadMessage(R_BAD_HANDOFF, "malformed handoff")
        sketch_rows = np.frombuffer(sketches, dtype="<f4").reshape(-1, SKETCH_DIMS)
        commitment = Commitment(
            hop=session.prev,
            entry=session.entry,
            session=session_field(value),
            model=model,
            layers=(layers[0], layers[1]),
            sketch_seed=uint_field(value, "seed", high=SEED_MODULUS - 1),
            step=step,
            pos=pos,
            count=count,
            inputs_digest=digest,
            inputs=sketch_rows[:in_rows].astype(np.float32),
            outputs=sketch_rows[in_rows:].astype(np.float32),
            token=None,
            previous=previous,
            signature=signature,
        )
    except (KeyError, BadMessage) as exc:
        raise BadMessage(R_BAD_HANDOFF, f"malformed handoff: {exc}") from None
    return commitment, receipt
