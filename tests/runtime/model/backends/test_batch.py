"""Batched steps (`forward_batch`) compute what each session's own steps do.

Sessions with different prompts (so different cache lengths and different
tokens: a row given another row's keys, positions or mask decodes other
tokens) are prefilled alone, then decode greedily, once with every step
alone and once in batches, on both backends, through the whole model as
one shard and through two chained shards; the tokens must be identical and
the logits equal within float rounding. The batches change between steps as
they will in a hop server: each step one session steps alone instead (its
cache must not depend on the batch it left) and the rows come in another
order. Families: Qwen3 (plain causal attention; also in q8), Gemma 2 (sliding window
shorter than the prompts, attention softcap on transformers' eager kernel,
grouped scores in mlx-lm) and Gemma 3 (sliding and full layers rotated at
different bases).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from runtime.model.backends.base import BackendError, KVCache, ShardBackend, ShardSpec
from runtime.model.backends.batching import BatchLayout
from runtime.model.backends.mlx_backend import load_mlx_shard
from runtime.model.backends.torch_backend import load_torch_shard
from runtime.model.tiny import SLIDING_WINDOW, make_tiny_model

LAYERS = 4
SPLIT = 2  # the two-shard chain is [0, SPLIT) and [SPLIT, LAYERS)
# Prompts of different lengths, most longer than the tiny models' sliding
# window, one a single token.
PROMPTS = ([1, 57, 203, 9, 330, 41], [7, 8], [100, 200, 300, 400, 50, 60, 70, 80, 90], [5])
DECODE_STEPS = 12
# fp32 bound on |batched - alone| logits (of magnitude ~1-30): a batch runs
# the same kernels on more rows and with an explicit mask, so only a
# reduction split differently can differ; measured <= 1e-6 on torch, 0 on MLX.
ATOL = 1e-5
# q8's bound: torch's int4 kernel computes in bfloat16, whose rounding (a
# step of 2^-8 relative) a kernel could split differently for more rows;
# measured 0 on both backends.
QUANTIZED_ATOL = 0.05
FAMILIES = ("qwen3", "gemma2", "gemma3")
LOADERS: dict[str, Callable[[ShardSpec], ShardBackend]] = {
    "torch": lambda spec: load_torch_shard(spec, "cpu"),
    "mlx": load_mlx_shard,
}


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family = request.param
    out = tmp_path_factory.mktemp(f"batch-{family}")
    return make_tiny_model(out, layers=LAYERS, family=family, with_manifest=False)


def _chain(
    backend: str, model_dir: Path, spans: Sequence[tuple[int, int]], recipe: str = "fp32"
) -> list[ShardBackend]:
    return [LOADERS[backend](ShardSpec(model_dir, a, b, recipe)) for a, b in spans]


class Session:
    """One conversation through a chain: its caches, tokens and logits."""

    def __init__(self, chain: Sequence[ShardBackend], prompt: list[int]) -> None:
        self.caches = [shard.new_cache() for shard in chain]
        self.tokens = list(prompt)
        self.fed = 0  # tokens the caches hold
        self.logits: list[np.ndarray] = []

    def feed(self, count: int | None) -> tuple[np.ndarray, np.ndarray]:
        """The next `count` tokens not yet fed (default: all) and their positions."""
        start = self.fed
        self.fed = len(self.tokens) if count is None else start + count
        return np.asarray(self.tokens[start : self.fed]), np.arange(start, self.fed)

    def take(self, logits: np.ndarray) -> None:
        """The greedy next token, once the caches hold every token."""
        if self.fed == len(self.tokens):
            self.logits.append(logits[-1])
            self.tokens.append(int(logits[-1].argmax()))


def _alone(chain: Sequence[ShardBackend], session: Session, count: int | None = None) -> None:
    x, positions = session.feed(count)
    for shard, cache in zip(chain, session.caches, strict=True):
        x = shard.forward(x, positions, cache)
    session.take(x)


def _batched(chain: Sequence[ShardBackend], sessions: list[Session]) -> None:
    """One batched step of every session's tokens not yet fed."""
    inputs = [s.feed(None) for s in sessions]
    xs = [x for x, _ in inputs]
    for index, shard in enumerate(chain):
        steps = [
            (x, positions, s.caches[index])
            for x, (_, positions), s in zip(xs, inputs, sessions, strict=True)
        ]
        xs = shard.forward_batch(steps)
    for session, logits in zip(sessions, xs, strict=True):
        session.take(logits)


def _decode(chain: Sequence[ShardBackend], batched: bool) -> list[Session]:
    """Prefill each prompt alone, then DECODE_STEPS greedy tokens each:
    alone, or batched with step k's lone session k % (sessions + 1) (none
    every sessions + 1 steps) and the rows reversed on odd steps."""
    sessions = [Session(chain, prompt) for prompt in PROMPTS]
    for session in sessions:
        _alone(chain, session)
    for step in range(DECODE_STEPS):
        if not batched:
            for session in sessions:
                _alone(chain, session)
            continue
        lone = step % (len(sessions) + 1)
        rows = [s for i, s in enumerate(sessions) if i != lone]
        if lone < len(sessions):
            _alone(chain, sessions[lone])
        _batched(chain, rows[::-1] if step % 2 else rows)
    return sessions


def _assert_same(alone: list[Session], batched: list[Session], atol: float = ATOL) -> None:
    for a, b in zip(alone, batched, strict=True):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(np.stack(b.logits), np.stack(a.logits), rtol=0, atol=atol)


@pytest.mark.parametrize("backend", sorted(LOADERS))
@pytest.mark.parametrize("spans", [[(0, LAYERS)], [(0, SPLIT), (SPLIT, LAYERS)]], ids=["1", "2"])
def test_batched_decode_matches_decoding_alone(
    model_dir: Path, backend: str, spans: list[tuple[int, int]]
) -> None:
    chain = _chain(backend, model_dir, spans)
    alone = _decode(chain, batched=False)
    # The sessions decode different tokens, so rows mixed up would show.
    continuations = {tuple(s.tokens[len(p) :]) for s, p in zip(alone, PROMPTS, strict=True)}
    assert len(continuations) == len(PROMPTS)
    _assert_same(alone, _decode(chain, batched=True))


@pytest.mark.parametrize("backend", sorted(LOADERS))
def test_quantized_batched_decode(qwen3_dir: Path, backend: str) -> None:
    """q8's matmuls (torch's int4 kernel on CPU, mlx's quantized matmul)
    take the batch's rows as they take one."""
    chain = _chain(backend, qwen3_dir, [(0, 8)], "q8")
    _assert_same(_decode(chain, batched=False), _decode(chain, batched=True), QUANTIZED_ATOL)


@pytest.mark.parametrize("backend", sorted(LOADERS))
def test_rows_of_different_lengths(model_dir: Path, backend: str) -> None:
    """One batch of a row finishing its prefill (the rest of its prompt
    after a first chunk) beside rows decoding one token: padded query
    slots, and the rows' lengths in another order than the rows."""
    chain = _chain(backend, model_dir, [(0, SPLIT), (SPLIT, LAYERS)])
    results = []
    for batched in (False, True):
        sessions = [Session(chain, prompt) for prompt in PROMPTS]
        _alone(chain, sessions[0], count=2)
        for session in sessions[1:]:
            _alone(chain, session)
        if batched:
            _batched(chain, sessions[::-1])
        else:
            for session in sessions:
                _alone(chain, session)
        results.append(sessions)
    _assert_same(*results)


@pytest.mark.parametrize("backend", sorted(LOADERS))
def test_bad_batches_are_refused(model_dir: Path, backend: str) -> None:
    (shard,) = _chain(backend, model_dir, [(0, LAYERS)])
    assert shard.forward_batch([]) == []
    cache = shard.new_cache()
    one = np.asarray([3])
    with pytest.raises(BackendError, match="two rows"):
        shard.forward_batch([(one, np.arange(1), cache), (one, np.arange(1), cache)])
    with pytest.raises(BackendError, match="continue the cache"):
        shard.forward_batch([(one, np.arange(1), shard.new_cache()), (one, np.asarray([4]), cache)])
    with pytest.raises(BackendError):
        shard.forward_batch([(one, np.arange(1), KVCache())])
    assert shard.forward_batch([(one, np.arange(1), cache)])[0].shape == (1, shard.vocab_size)


def test_layout_mask_sees_each_rows_own_keys() -> None:
    """Row 0: 2 cached + 1 new token; row 1: 0 cached + 2 new (one padding
    query slot for row 0, one padding key slot)."""
    rows = BatchLayout(past=(2, 0), counts=(1, 2))
    assert (rows.width, rows.key_slots) == (2, 3)
    np.testing.assert_array_equal(rows.position_ids(), [[2, 3], [0, 1]])
    mask = rows.mask(window=None)[:, 0]
    np.testing.assert_array_equal(mask[0], [[1, 1, 1], [1, 1, 1]])  # slot 1: padding
    np.testing.assert_array_equal(mask[1], [[1, 0, 0], [1, 1, 0]])
    windowed = rows.mask(window=2)[:, 0]
    np.testing.assert_array_equal(windowed[0], [[0, 1, 1], [0, 0, 1]])
    assert max(map(len, PROMPTS)) > SLIDING_WINDOW  # the decode tests slide
