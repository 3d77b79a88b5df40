"""Fault: a hop that lies in what it serves, after its doctor admitted it honestly.

``SHARDMESH_TEST_FAULT=lying_hop:<mode>`` patches the node's hop server, the
code that serves chat steps: the doctor (which loads and probes the shard
itself) and the capability re-checks see an honest shard, as they would on
a node patched by someone who knows what the doctor tests. Modes, the
issue's cases:

* ``noise``: every step's output gets noise of half its own spread (a);
* ``rare:<p>``: each step lies so with probability p, e.g. ``rare:0.01`` (b);
* ``swap``: the last hop emits the next token id instead of the one it
  sampled, and signs that (c);
* ``late:<n>``: honest for its first n served steps, then ``noise`` (d);
* ``transit``: computes and commits every step honestly, then forwards
  noise in place of the activations it committed (issue 30, item 4);
* ``mismatch``: the last hop commits the token it sampled, then emits the
  next token id instead (issue 30, item 4);
* ``equivocate``: commits every step honestly to the entry, and sends the
  next hop noise with another commitment, one that agrees with the noise
  (issue 30, item 4: only the receipt the next hop relays gives it away).

The last two lie between the commitment and the wire: whatever the hop
server sends is sent as it would be, so each is what an attacker gets who
patches only what goes out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from runtime.inference import hop_server
from runtime.inference.commitment import sketch
from runtime.inference.protocol import encode_message

NOISE = 0.5
"""Relative to the output's own spread: garbage text, as in the issue."""


class _LyingShard:
    """The real shard, whose forward lies on the steps ``lies`` picks; a
    batched forward's rows are served steps each, and lie each the same way."""

    def __init__(self, shard: Any, lies: Any) -> None:
        self._shard = shard
        self._lies = lies
        self._served = 0
        self._rng = np.random.default_rng(7)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shard, name)

    def forward(self, inputs: np.ndarray, positions: np.ndarray, cache: Any) -> np.ndarray:
        return self._served_step(self._shard.forward(inputs, positions, cache))

    def forward_batch(
        self, steps: Sequence[tuple[np.ndarray, np.ndarray, Any]]
    ) -> list[np.ndarray]:
        return [self._served_step(output) for output in self._shard.forward_batch(steps)]

    def _served_step(self, output: np.ndarray) -> np.ndarray:
        served, self._served = self._served, self._served + 1
        if not self._lies(served, self._rng):
            return output
        noise = self._rng.standard_normal(output.shape).astype(np.float32)
        return output + NOISE * float(output.std()) * noise


def _lie_in_transit(mode: str) -> None:
    """Patch what a step sends, after its honest commitment is made: every
    step's result, alone or a row of a batch, comes from `_committed`."""
    honest_step = hop_server.HopServer._committed
    rng = np.random.default_rng(11)

    def lying_step(self: Any, session: Any, work: Any, *computed: Any) -> Any:
        result = honest_step(self, session, work, *computed)
        if mode == "transit" and result.hidden is not None:
            spread = float(result.hidden.std())
            noise = rng.standard_normal(result.hidden.shape).astype(np.float32)
            return dataclasses.replace(result, hidden=result.hidden + NOISE * spread * noise)
        if mode == "mismatch" and result.token is not None:
            return dataclasses.replace(result, token=(result.token + 1) % self.shard.vocab_size)
        return result

    hop_server.HopServer._committed = lying_step  # type: ignore[method-assign]


def _equivocate() -> None:
    """Patch what a middle step sends: noise and a commitment to it for the
    next hop, the honest commitment for the entry."""
    honest_push = hop_server.HopServer._push
    rng = np.random.default_rng(13)

    def lying_push(self: Any, session: Any, work: Any, result: Any) -> None:
        honest = result.commitment
        if result.hidden is None or honest is None:
            honest_push(self, session, work, result)
            return
        noise = rng.standard_normal(result.hidden.shape).astype(np.float32)
        noisy = result.hidden + NOISE * float(result.hidden.std()) * noise
        seed = honest.sketch_seed
        other = dataclasses.replace(honest, outputs=sketch(noisy, seed), signature=b"")
        send = self.plane.send

        def split(address: str, message: Any, *, peer: bytes) -> None:
            if peer == session.entry:  # the commit: the honest one
                header = {
                    "op": "commit",
                    "session": session.id,
                    **honest.header_fields(),
                    **hop_server._relay(work),
                }
                message = encode_message(header, honest.payload())
            send(address, message, peer=peer)

        self.plane.send = split
        lying = dataclasses.replace(result, hidden=noisy, commitment=other)
        try:
            honest_push(self, session, work, lying)
        finally:
            self.plane.send = send

    hop_server.HopServer._push = lying_push  # type: ignore[method-assign]


def install(argument: str) -> None:
    mode, _, value = argument.partition(":")
    if mode in ("transit", "mismatch"):
        _lie_in_transit(mode)
        return
    if mode == "equivocate":
        _equivocate()
        return
    if mode == "swap":
        honest_sample = hop_server.sample

        def swapped(logits: np.ndarray, params: Any, **how: Any) -> int:
            return (honest_sample(logits, params, **how) + 1) % logits.shape[0]

        hop_server.sample = swapped
        return
    lies = {
        "noise": lambda served, rng: True,
        "rare": lambda served, rng: rng.random() < float(value),
        "late": lambda served, rng: served >= int(value),
    }[mode]
    honest_init = hop_server.HopServer.__init__

    def lying_init(self: Any, plane: Any, shard: Any, **kwargs: Any) -> None:
        honest_init(self, plane, _LyingShard(shard, lies), **kwargs)

    hop_server.HopServer.__init__ = lying_init  # type: ignore[method-assign]
