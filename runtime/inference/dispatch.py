"""A node's inference engine: the one reader of its data plane.

A node is at once a hop (it serves a shard to other entries) and an entry
(it drives chains for its own chats), and a plane has one receiver, so
`Engine` owns the receive loop: it decodes each message, counts and drops
what does not parse, and dispatches hop ops to the `HopServer` and replies
to the `Pipeline`. The loop never waits on compute, so one slow forward
never delays another session's messages.

Typical wiring: docs/design/inference-protocol.md#the-engine-one-reader-of-the-data-plane.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Final

import trio

from mesh.identity import Signer
from mesh.transport import Plane
from mesh.wire import DecodeError, decode_tensor
from runtime.inference.chain import Pipeline
from runtime.inference.commitment import SKETCH_DIMS
from runtime.inference.hop_server import DEFAULT_MAX_BUDGET, HopServer
from runtime.inference.protocol import ENTRY_OPS, HOP_OPS, OP_OPEN, R_WRONG_SHARD, refuse_open

__all__ = ["Engine"]

R_UNKNOWN_OP: Final = "unknown_op"
R_OVERSIZED: Final = "oversized"

REPLY_MAX_BYTES: Final = 64 * 1024 + DEFAULT_MAX_BUDGET * 2 * SKETCH_DIMS * 4
"""The largest message a node that serves no shard takes: an entry gets
only replies (``opened``, ``busy``, ``token``, ``error``, ``commit``):
headers of well under a kilobyte, and a step's commitment, whose sketches
are at most two float32 rows of ``SKETCH_DIMS`` per position of a whole
budget (a prefill's). A node with a shard takes what its sessions can need
(`HopServer.max_message_bytes`). Anything bigger is refused before it is
decoded. Every reply fits one chunk of the data plane
(`mesh.chunks.SINGLE_MESSAGE_BYTES`), so an entry allows no peer bigger
messages (`Engine.bulk_allowance`), and libzmq holds at most one chunk of a
frame before that (docs/design/transport.md#byte-budgets)."""


class Engine:
    """Dispatches a node's data-plane messages to its hop server and pipeline."""

    def __init__(
        self,
        plane: Plane,
        *,
        drops: Counter[str],
        signer: Signer,
        hop_server: HopServer | None = None,
        reply_address: str | None = None,
    ) -> None:
        """``reply_address`` is this node's advertised data address (default:
        the plane's bound address), where hops send this entry's replies;
        ``signer`` is the node's identity, which signs the commitments of
        the shards it serves (its hop servers take it from here)."""
        self.plane = plane
        self.signer = signer
        if reply_address is not None:
            plane.add_own_address(reply_address)
        self.hop_server = hop_server
        self.pipeline = Pipeline(plane, drops=drops, reply_address=reply_address)
        self._drops = drops
        self._nursery: trio.Nursery | None = None
        self._hop_scope: trio.CancelScope | None = None

    @property
    def sessions(self) -> int:
        """Inference sessions open on this node as a hop (``/v1/network/status``)."""
        return 0 if self.hop_server is None else self.hop_server.sessions

    @property
    def max_message_bytes(self) -> int:
        """The largest message this node takes: replies (``REPLY_MAX_BYTES``),
        and what the sessions of its shard can need. Bigger ones are refused
        before they are decoded."""
        hop = self.hop_server
        return REPLY_MAX_BYTES if hop is None else max(REPLY_MAX_BYTES, hop.max_message_bytes)

    @property
    def hop_stats(self) -> dict[str, Any] | None:
        """What the attached shard has computed (None: no shard), for
        ``/v1/network/status``."""
        return None if self.hop_server is None else self.hop_server.stats.to_json()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the data plane until cancelled or the plane closes."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.hop_server is not None:
                await nursery.start(self.hop_server.run)
            task_status.started()
            # The plane's reader calls dispatch itself (a scheduler round
            # less per hop). This loop gets what was queued before that and
            # what the node sends itself (an entry that is its own first or
            # last hop), and ends when the plane closes.
            self.plane.deliver_to(self.dispatch)
            self.plane.allow_bulk(self.bulk_allowance)
            try:
                while True:
                    self.dispatch(*await self.plane.receive())
            except (trio.EndOfChannel, trio.ClosedResourceError):
                nursery.cancel_scope.cancel()
            finally:
                self.plane.allow_bulk(None)
                self.plane.deliver_to(None)

    def bulk_allowance(self, peer: bytes) -> int:
        """How big a message node ``peer`` may send us now (the plane asks
        before it reassembles a chunked one): what the attached shard's
        sessions take from it. An entry takes only replies, each within one
        chunk (``REPLY_MAX_BYTES``), so without a shard nobody may."""
        hop = self.hop_server
        return 0 if hop is None else hop.bulk_allowance(peer)

    async def attach(self, hop_server: HopServer) -> None:
        """Start serving a shard on a running engine: a node admits its
        shard (the doctor) after its planes are up, so the hop server
        arrives later than the engine."""
        if self._nursery is None:
            raise RuntimeError("attach() needs a running engine")
        if self.hop_server is not None:
            raise RuntimeError("this engine already serves a shard")
        self._hop_scope = trio.CancelScope()
        await self._nursery.start(self._serve_hops, hop_server, self._hop_scope)
        self.hop_server = hop_server

    def detach(self) -> None:
        """Stop serving the attached shard (a managed assignment was
        released or replaced): its sessions close, and later hop messages
        are refused as a stale route."""
        if self._hop_scope is not None:
            self._hop_scope.cancel()
        self._hop_scope = None
        self.hop_server = None

    @staticmethod
    async def _serve_hops(
        hop_server: HopServer,
        scope: trio.CancelScope,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with scope:
            await hop_server.run(task_status=task_status)

    def dispatch(self, peer: bytes, frames: list[bytes]) -> None:
        """Handle one message from node ``peer`` (authenticated by the
        plane); never raises for bad input."""
        if sum(len(frame) for frame in frames) > self.max_message_bytes:
            self._drops[f"engine.{R_OVERSIZED}"] += 1
            return
        try:
            header, dtype, shape, raw = decode_tensor(frames)
        except DecodeError as exc:
            self._drops[f"engine.{exc.reason}"] += 1
            return
        op = header.get("op")
        if op in HOP_OPS:
            if self.hop_server is None:  # a stale route: we hold no shard (any more)
                self._drops[f"engine.{R_WRONG_SHARD}"] += 1
                if op == OP_OPEN:
                    refuse_open(
                        self.plane, peer, header, R_WRONG_SHARD, "this node serves no shard"
                    )
                return
            # Only an open needs where it came from (the session policy's networks).
            source = self.plane.source_of(peer) if op == OP_OPEN else None
            self.hop_server.handle(peer, op, header, dtype, shape, raw, source=source)
        elif op in ENTRY_OPS:
            self.pipeline.handle(peer, op, header, dtype, shape, raw)
        else:
            self._drops[f"engine.{R_UNKNOWN_OP}"] += 1
