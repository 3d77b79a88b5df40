"""The engine's data-plane protocol, and the hop side of it.

A chat request is carried through a *chain* of hops, each running one shard
(layers [a, b)) of the model. The entry node opens a *session* on every hop,
pushes the prompt into the first hop, and each hop pushes its activations
straight to the next; the last hop samples a token and sends it back to the
entry. Only the token comes back to the entry, so a decode step costs one
message per hop plus one reply, never a round trip through the entry per hop.

Messages
========
Every message is one tensor frame pair from :func:`mesh.wire.encode_tensor`:
a strict CBOR header (dtype, shape, and the map below) and the raw element
bytes. Ops without a payload carry a 0-length uint8 tensor. Session ids are 32
lowercase hex characters (16 random bytes, made by the entry, one per hop).

=========  ===========  =========================================================
op         direction    header fields (besides "op") and payload
=========  ===========  =========================================================
open       entry → hop  session, model (text), layers [a, b], reply (the entry's
                        data address), budget (positions the session may use),
                        next (next hop's data address, or null on the last hop),
                        next_session (its session id, or null), sampling (null,
                        or {temperature, top_p, top_k} on the last hop), seed
opened     hop → entry  session
busy       hop → entry  session, reason (session limit reached; try another node)
forward    → hop        session, step, pos, compute_us (optional, see below):
                        token ids int64 [T] into the first hop, hidden states
                        float32 [T, H] into the others
token      hop → entry  session (the last hop's), step, token, compute_us
error      hop → entry  session, step (or null), reason
close      entry → hop  session (idempotent; no reply)
=========  ===========  =========================================================

``step`` is the index of the token being produced (0 for the first generated
token), so the last hop can sample with a generator seeded by (seed, step):
a replay after failover draws exactly the tokens an uninterrupted run would.
``pos`` is the absolute position of the first of the T inputs.
``compute_us`` lists, in chain order, how long each hop so far took to
compute this step (microseconds, by its own clock); each hop appends its own
before pushing on, so the entry learns where a step's time went (compute at
each hop, or the hops between them) at the cost of a few header bytes.

Why the hop behaves as it does
==============================
* The receive loop (see :mod:`runtime.inference.dispatch`) never waits on compute: it
  validates a forward and hands it to the session's own task through a small
  queue, so one session's steps run strictly in order while the loop keeps
  serving other sessions. A prefill runs in a worker thread
  (``trio.to_thread.run_sync``) so the node keeps serving meanwhile; a
  one-token decode step runs on the loop itself (``INLINE_MAX_TOKENS``).
  Either way one forward at a time per shard (a device is one resource; two
  forwards at once mostly contend).
* Bad input (wrong dtype or shape, unknown session, position that does not
  continue the cache, over budget) is counted per reason in the node's drops
  and answered with ``error`` whenever the session, and so the entry's
  address, is known. Nothing a peer sends can crash the server.
* An ``error`` ends the session: the entry abandons the whole chain on any
  failed step (it reroutes and replays), so keeping the cache would only hold
  memory until the idle reaper.
* A forward for an unknown session cannot be answered (it carries no reply
  address, to keep per-step headers small); the entry notices through its
  step timeout instead.
"""

from __future__ import annotations

import re
import secrets
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import numpy as np
import trio

from mesh.transport import Plane
from mesh.wire import MAX_ADDR_CHARS, encode_tensor
from runtime.model.backends.base import KVCache, ShardBackend
from runtime.model.sampling import SEED_MODULUS, SamplingParams, sample

T = TypeVar("T")

INLINE_MAX_TOKENS: Final = 1
"""Decode steps (one token) run on the event loop itself; prefills and
replays go to a worker thread. A decode step is short (well under the
profiles' timer granularity for the shards a node holds), while a thread
handoff costs ~0.5 ms per hop in GIL ping-pong on Python-heavy forwards,
measured on loopback: half of a hop's overhead. A prefill can take seconds
and would stall membership and Raft, so it never runs inline."""

__all__ = [
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_MAX_BUDGET",
    "DEFAULT_MAX_SESSIONS",
    "ENTRY_OPS",
    "HOP_OPS",
    "OP_BUSY",
    "OP_CLOSE",
    "OP_ERROR",
    "OP_FORWARD",
    "OP_OPEN",
    "OP_OPENED",
    "OP_TOKEN",
    "BadMessage",
    "HopServer",
    "HopStats",
    "compute_us_field",
    "encode_message",
    "new_session_id",
    "refuse_open",
    "sampling_from_header",
    "sampling_header",
    "session_field",
    "text_field",
    "uint_field",
]

# --- protocol ---------------------------------------------------------------

OP_OPEN: Final = "open"
OP_OPENED: Final = "opened"
OP_BUSY: Final = "busy"
OP_FORWARD: Final = "forward"
OP_TOKEN: Final = "token"
OP_ERROR: Final = "error"
OP_CLOSE: Final = "close"
HOP_OPS: Final = frozenset({OP_OPEN, OP_FORWARD, OP_CLOSE})
ENTRY_OPS: Final = frozenset({OP_OPENED, OP_BUSY, OP_TOKEN, OP_ERROR})

SESSION_ID_BYTES: Final = 16  # 128 random bits: collisions are never a concern
_SESSION_ID = re.compile(r"[0-9a-f]{32}")
# Model names and error reasons are short text; capping them keeps a hostile
# header from making us hold or echo kilobytes.
MAX_NAME_CHARS: Final = 256
MAX_REASON_CHARS: Final = 300
MAX_CHAIN_HOPS: Final = 256
"""Most per-hop timings a step may carry: a hop holds at least one layer and
no model we know of has more layers; bounds what a header makes us parse."""
_MAX_INT: Final = 2**63 - 1

# Drop reasons (counted as "engine.<reason>" in the node's drops).
R_BAD_FIELD: Final = "bad_field"  # missing or mistyped header field
R_BAD_PAYLOAD: Final = "bad_payload"  # wrong dtype or shape for this hop
R_UNKNOWN_SESSION: Final = "unknown_session"
R_BAD_POSITION: Final = "bad_position"  # does not continue the session's cache
R_BUDGET: Final = "budget_exceeded"
R_OVERLOADED: Final = "overloaded"  # too many steps queued for one session
R_SHARD_FAILED: Final = "shard_failed"
R_WRONG_SHARD: Final = "wrong_shard"  # open for a model or layers we do not serve
R_DUPLICATE: Final = "duplicate_session"

_EMPTY: Final = np.zeros(0, dtype=np.uint8)


class BadMessage(Exception):
    """A data-plane header we refuse; ``reason`` is a drop reason."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def new_session_id() -> str:
    """A fresh session id (the entry makes one per hop per attempt)."""
    return secrets.token_hex(SESSION_ID_BYTES)


def encode_message(header: Mapping[str, Any], array: np.ndarray | None = None) -> list[Any]:
    """The two frames of one data-plane message. ``array`` (C-contiguous) is
    passed to ZeroMQ by reference, not copied; the caller must not modify it."""
    payload = _EMPTY if array is None else np.ascontiguousarray(array)
    return encode_tensor(header, memoryview(payload), dtype=payload.dtype.name, shape=payload.shape)


# Field readers shared with the entry side: each returns the checked value
# or raises BadMessage(bad_field), so a handler validates as it reads.


def session_field(header: Mapping[str, Any], key: str = "session") -> str:
    value = header.get(key)
    if type(value) is not str or not _SESSION_ID.fullmatch(value):
        raise BadMessage(R_BAD_FIELD, f"{key} must be a 32-char hex session id")
    return value


def uint_field(header: Mapping[str, Any], key: str) -> int:
    value = header.get(key)
    if type(value) is not int or not 0 <= value <= _MAX_INT:
        raise BadMessage(R_BAD_FIELD, f"{key} must be a non-negative integer")
    return value


def compute_us_field(header: Mapping[str, Any]) -> tuple[int, ...]:
    """The per-hop compute times a step carries (none before the first hop)."""
    value = header.get("compute_us", [])
    if (
        type(value) is not list
        or len(value) > MAX_CHAIN_HOPS
        or not all(type(us) is int and 0 <= us <= _MAX_INT for us in value)
    ):
        raise BadMessage(
            R_BAD_FIELD, f"compute_us must list at most {MAX_CHAIN_HOPS} non-negative integers"
        )
    return tuple(value)


def text_field(header: Mapping[str, Any], key: str, limit: int) -> str:
    value = header.get(key)
    if type(value) is not str or not 0 < len(value) <= limit:
        raise BadMessage(R_BAD_FIELD, f"{key} must be text of 1..{limit} characters")
    return value


def refuse_open(plane: Plane, header: Mapping[str, Any], reason: str, detail: str = "") -> None:
    """Answer a refused ``open`` with ``error``, so the entry fails over at
    once instead of waiting for its open timeout; silent when the header
    names no valid reply address and session (there is no one to answer)."""
    try:
        reply = text_field(header, "reply", MAX_ADDR_CHARS)
        session_id = session_field(header)
    except BadMessage:
        return
    error = {"op": OP_ERROR, "session": session_id, "step": None, "reason": _reason(reason, detail)}
    plane.send(reply, encode_message(error))


def sampling_header(params: SamplingParams) -> dict[str, Any]:
    """What the last hop needs of the sampling parameters (max_tokens and stop
    sequences stay with the entry)."""
    return {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k}


def sampling_from_header(value: object) -> SamplingParams:
    """Rebuild and validate the parameters an ``open`` carries; raises
    :class:`BadMessage`."""
    if not isinstance(value, dict) or set(value) != {"temperature", "top_p", "top_k"}:
        raise BadMessage(R_BAD_FIELD, "sampling must be {temperature, top_p, top_k}")
    try:
        return SamplingParams(**value)
    except ValueError as exc:  # SamplingParams checks types and ranges
        raise BadMessage(R_BAD_FIELD, f"sampling.{exc}") from None


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
    reaped: int = 0  # sessions closed by the idle reaper

    def count(self, tokens: int, seconds: float) -> None:
        if tokens == 1:  # a decode step; more tokens are a prefill or a replay
            self.decode_steps += 1
            self.decode_compute_s += seconds
        else:
            self.prefill_steps += 1
            self.prefill_tokens += tokens
            self.prefill_compute_s += seconds

    def to_json(self) -> dict[str, Any]:
        return {
            "decode_steps": self.decode_steps,
            "decode_compute_s": round(self.decode_compute_s, 6),
            "prefill_steps": self.prefill_steps,
            "prefill_tokens": self.prefill_tokens,
            "prefill_compute_s": round(self.prefill_compute_s, 6),
            "reaped": self.reaped,
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


@dataclass(eq=False)
class _Session:
    """One conversation's state on this hop."""

    id: str
    reply: str  # the entry's data address
    next_addr: str | None
    next_session: str | None
    budget: int
    sampling: SamplingParams | None
    seed: int
    cache: KVCache
    last_used: float
    # Position the next forward must start at, counting steps already queued.
    next_pos: int = 0
    # Steps handed to the session's task and not finished: while any are,
    # a new step must queue behind them, never run ahead in the receive loop,
    # and the session is not idle (a long prefill on slow hardware, or steps
    # waiting for a busy shard, are never reaped).
    queued: int = 0
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    inbox: trio.MemorySendChannel[_Step] | None = None


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
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_budget: int = DEFAULT_MAX_BUDGET,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        if max_sessions < 1 or max_budget < 1 or idle_timeout_s <= 0:
            raise ValueError("max_sessions, max_budget and idle_timeout_s must be positive")
        self.plane = plane
        self.shard = shard
        self.model = model
        self.max_sessions = max_sessions
        self.max_budget = max_budget
        self.idle_timeout_s = idle_timeout_s
        self.stats = HopStats()
        self._drops = drops
        self._sessions: dict[str, _Session] = {}
        # One forward at a time on this shard's device (see the module docstring).
        self._compute = trio.CapacityLimiter(1)
        self._nursery: trio.Nursery | None = None

    @property
    def sessions(self) -> int:
        """Open sessions (for ``/v1/network/status``)."""
        return len(self._sessions)

    async def on_shard(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` in a worker thread, never at the same time as a
        session's forward: the node's capability re-check runs its probe on
        the shard this server holds, and backends are not thread-safe."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self._compute)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host the session tasks and reap idle sessions, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
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
        self, op: str, header: Mapping[str, Any], dtype: str, shape: tuple[int, ...], raw: Any
    ) -> None:
        """Act on one hop message (``open``, ``forward`` or ``close``). Never
        raises for bad input: refusals are counted and answered if possible."""
        session: _Session | None = None
        try:
            if op == OP_FORWARD:
                session = self._sessions.get(session_field(header))
                if session is None:
                    raise BadMessage(R_UNKNOWN_SESSION)
                self._forward(session, header, dtype, shape, raw)
            elif op == OP_OPEN:
                self._open(header)
            else:
                found = self._sessions.get(session_field(header))
                if found is not None:
                    self._close(found)
        except BadMessage as exc:
            self._drops[f"engine.{exc.reason}"] += 1
            if session is not None:
                self._fail(session, header.get("step"), exc.reason, exc.detail)

    # --- open / close -------------------------------------------------------

    def _open(self, header: Mapping[str, Any]) -> None:
        reply = text_field(header, "reply", MAX_ADDR_CHARS)
        session_id = session_field(header)
        if len(self._sessions) >= self.max_sessions:
            self._drops["engine.busy"] += 1
            busy = f"session limit ({self.max_sessions}) reached"
            self._send(reply, {"op": OP_BUSY, "session": session_id, "reason": busy})
            return
        try:
            session = self._new_session(session_id, reply, header)
        except BadMessage as exc:
            refuse_open(self.plane, header, exc.reason, exc.detail)
            raise
        # The engine starts run() before it reads the plane, and both end together.
        assert self._nursery is not None, "HopServer.run is not running"
        send, receive = trio.open_memory_channel[_Step](SESSION_QUEUE)
        session.inbox = send
        self._sessions[session_id] = session
        self._nursery.start_soon(self._serve, session, receive, name=f"hop.session.{session_id}")
        self._send(reply, {"op": OP_OPENED, "session": session_id})

    def _new_session(self, session_id: str, reply: str, header: Mapping[str, Any]) -> _Session:
        """Validate an ``open`` against what this hop serves."""
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
        seed = header.get("seed")
        if type(seed) is not int or not 0 <= seed < SEED_MODULUS:
            raise BadMessage(R_BAD_FIELD, "seed must be an integer in [0, 2**64)")
        if self.shard.is_last:
            if header.get("next") is not None or header.get("next_session") is not None:
                raise BadMessage(R_BAD_FIELD, "the last hop has no next hop")
            next_addr = next_session = None
            sampling: SamplingParams | None = sampling_from_header(header.get("sampling"))
        else:
            next_addr = text_field(header, "next", MAX_ADDR_CHARS)
            next_session = session_field(header, "next_session")
            sampling = None
        return _Session(
            id=session_id,
            reply=reply,
            next_addr=next_addr,
            next_session=next_session,
            budget=budget,
            sampling=sampling,
            seed=seed,
            cache=self.shard.new_cache(),
            last_used=trio.current_time(),
        )

    def _close(self, session: _Session) -> None:
        if self._sessions.get(session.id) is session:
            del self._sessions[session.id]
        session.scope.cancel()
        if session.inbox is not None:
            session.inbox.close()

    def _reap(self, now: float) -> None:
        for session in list(self._sessions.values()):
            if not session.queued and now - session.last_used >= self.idle_timeout_s:
                self.stats.reaped += 1
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
        # A copy: the frame's bytes are read-only and torch refuses to wrap
        # read-only memory without a warning. One activation row per decode step.
        inputs = np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
        work = _Step(step, pos, inputs, compute_us)
        if shape[0] <= INLINE_MAX_TOKENS and not session.queued and self._compute.available_tokens:
            # Nothing of this session's is ahead of it and the shard is free.
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
                        if work.inputs.shape[0] <= INLINE_MAX_TOKENS:
                            async with self._compute:
                                result, took_us = self._compute_step(session, work)
                        else:
                            result, took_us = await trio.to_thread.run_sync(
                                self._compute_step, session, work, limiter=self._compute
                            )
                    except Exception as exc:  # a failing shard must not take the server down
                        self._shard_failed(session, work.step, exc)
                        return
                    finally:
                        session.queued -= 1
                    self._push(session, work, result, took_us)
            finally:
                self._close(session)

    def _run_now(self, session: _Session, work: _Step) -> None:
        """Run a decode step right here in the receive loop, as the session's
        task would, minus the hand-off: the step runs on the event loop
        either way (``INLINE_MAX_TOKENS``), and skipping the queue and the
        limiter's checkpoint saves two scheduler rounds per hop, which is
        most of what a hop's Python costs beyond the forward itself."""
        self._compute.acquire_nowait()
        try:
            result, took_us = self._compute_step(session, work)
        except Exception as exc:  # a failing shard must not take the server down
            self._shard_failed(session, work.step, exc)
            return
        finally:
            self._compute.release()
        self._push(session, work, result, took_us)

    def _push(self, session: _Session, work: _Step, result: int | np.ndarray, took_us: int) -> None:
        """Send a step's result on: the token to the entry, or the
        activations to the next hop, with this hop's time appended."""
        session.last_used = trio.current_time()
        compute_us = [*work.compute_us, took_us]
        if isinstance(result, int):
            header = {"op": OP_TOKEN, "session": session.id, "step": work.step}
            self._send(session.reply, {**header, "token": result, "compute_us": compute_us})
        else:
            assert session.next_addr is not None
            header = {
                "op": OP_FORWARD,
                "session": session.next_session,
                "step": work.step,
                "pos": work.pos,
                "compute_us": compute_us,
            }
            self.plane.send(session.next_addr, encode_message(header, result))

    def _shard_failed(self, session: _Session, step: int, exc: Exception) -> None:
        self._drops[f"engine.{R_SHARD_FAILED}"] += 1
        self._fail(session, step, R_SHARD_FAILED, f"{type(exc).__name__}: {exc}")

    def _compute_step(self, session: _Session, work: _Step) -> tuple[int | np.ndarray, int]:
        """The shard's forward, and on the last hop the sampled token; with
        the microseconds it took."""
        tokens = work.inputs.shape[0]
        positions = np.arange(work.pos, work.pos + tokens, dtype=np.int64)
        began = time.perf_counter()
        output = self.shard.forward(work.inputs, positions, session.cache)
        result: int | np.ndarray = output
        if session.sampling is not None:
            result = sample(output[-1], session.sampling, seed=session.seed, step=work.step)
        took = time.perf_counter() - began
        # Only one forward runs at a time (the compute limiter), so this is
        # the stats' only writer even when it runs in a worker thread.
        self.stats.count(tokens, took)
        return result, round(took * 1e6)

    def _fail(self, session: _Session, step: object, reason: str, detail: str) -> None:
        """Tell the entry this session failed, and end it."""
        self._send(
            session.reply,
            {
                "op": OP_ERROR,
                "session": session.id,
                "step": step if type(step) is int and 0 <= step <= _MAX_INT else None,
                "reason": _reason(reason, detail),
            },
        )
        self._close(session)

    def _send(self, addr: str, header: Mapping[str, Any]) -> None:
        self.plane.send(addr, encode_message(header))


def _reason(reason: str, detail: str) -> str:
    return (f"{reason}: {detail}" if detail else reason)[:MAX_REASON_CHARS]
