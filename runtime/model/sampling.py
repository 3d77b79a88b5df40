"""Sampling: OpenAI's parameters, a pure token sampler, and stop sequences.

The last hop of a chain turns logits into a token with `sample` (and,
when asked, into OpenAI's logprobs with `token_logprobs`), and the entry
node holds generated text back with `StopScanner` until it knows the text
is not the start of a stop sequence.

Why the sampler is a pure function of `(logits, params, seed, step)`: the
last hop can change in the middle of a stream (failover re-routes its span
and replays the history), so no random state may live on a hop. The draw for
step n depends only on the seed and n, never on how many draws some earlier
hop made, so a request with a seed produces the same text whether or not a
failover happened, and a replayed step draws the same token it drew before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from runtime.model.grammar import Constraint

MAX_TEMPERATURE = 2.0
"""OpenAI's upper bound; past it text is noise anyway."""

MAX_PENALTY = 2.0
"""OpenAI's bound on `presence_penalty` and `frequency_penalty` (either sign)."""

MAX_STOP_SEQUENCES = 4
"""OpenAI accepts up to four stop sequences; clients written for it send no more."""

SEED_MODULUS = 2**64
"""Seeds are reduced to 64 bits: numpy's SeedSequence takes non-negative
integers, and clients send any int64 (negative ones included)."""

NUCLEUS_FIRST_CANDIDATES = 64
"""The nucleus (top-p) is first looked for among this many best tokens, and
the candidate set grows by `NUCLEUS_GROWTH` while their mass is short of
top_p. A full stable sort of a 150k vocabulary costs ~25 ms per token, a
partition ~4 ms; for a trained model the nucleus is almost always a few dozen
tokens, so one partition usually suffices."""

NUCLEUS_GROWTH = 8
"""Factor the nucleus candidate set grows by: a flat distribution reaches
the whole vocabulary in a few partitions instead of many."""


class SamplingParamError(ValueError):
    """A sampling parameter is invalid; `param` names it as the request spelled it,
    so the API can answer 400 with OpenAI's `param` field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def _number(param: str, value: object) -> float:
    # bool is an int subclass; JSON `true` is not a temperature.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SamplingParamError(param, f"must be a number, not {type(value).__name__}")
    if not math.isfinite(value):
        raise SamplingParamError(param, "must be finite")
    return float(value)


def _integer(param: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamError(param, f"must be an integer, not {type(value).__name__}")
    return value


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each token; validated on construction.

    - `temperature` in [0, 2]; 0 means greedy (argmax, ties to the lowest id).
    - `top_p` in (0, 1]: keep the smallest set of best tokens whose
      probability mass reaches it (nucleus); 1 keeps all.
    - `top_k` >= 0: keep only the k best tokens; 0 turns it off.
    - `seed`: the client's seed, or None; then the entry draws one per
      session and passes it to `sample` (see there).
    - `max_tokens` >= 1, or None for "until the end of sequence or the
      context window", which only the engine knows.
    - `stop`: up to four non-empty strings; the text ends before the first
      occurrence of any of them, which is not returned.
    - `presence_penalty`, `frequency_penalty` in [-2, 2]: subtracted from
      the logit of each token already generated (once, and once per time
      it was generated), as OpenAI defines them; see `penalized`.
    - `constraint`: what the output must be (runtime.model.grammar), or None.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        temperature = _number("temperature", self.temperature)
        if not 0 <= temperature <= MAX_TEMPERATURE:
            raise SamplingParamError("temperature", f"must be between 0 and {MAX_TEMPERATURE}")
        top_p = _number("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise SamplingParamError("top_p", "must be greater than 0 and at most 1")
        if _integer("top_k", self.top_k) < 0:
            raise SamplingParamError("top_k", "must be 0 (off) or positive")
        if self.seed is not None:
            seed = _integer("seed", self.seed)
            if not -SEED_MODULUS // 2 <= seed < SEED_MODULUS:
                raise SamplingParamError("seed", "must fit in 64 bits")
        if self.max_tokens is not None and _integer("max_tokens", self.max_tokens) < 1:
            raise SamplingParamError("max_tokens", "must be at least 1")
        if not isinstance(self.stop, tuple | list) or len(self.stop) > MAX_STOP_SEQUENCES:
            raise SamplingParamError("stop", f"must be a list of at most {MAX_STOP_SEQUENCES}")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise SamplingParamError("stop", "every stop sequence must be a non-empty string")
        for name in ("presence_penalty", "frequency_penalty"):
            penalty = _number(name, getattr(self, name))
            if not -MAX_PENALTY <= penalty <= MAX_PENALTY:
                raise SamplingParamError(name, f"must be between -{MAX_PENALTY} and {MAX_PENALTY}")
            object.__setattr__(self, name, penalty)
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "stop", tuple(self.stop))

    @classmethod
    def from_request(cls, body: Mapping[str, Any]) -> SamplingParams:
        """The parameters of an OpenAI chat completion request body.

        JSON `null` means the default, as in OpenAI's API. `stop` may be one
        string or a list; `max_completion_tokens` (OpenAI's newer name) is
        read when `max_tokens` is absent; `response_format` becomes the
        `constraint` (runtime.model.grammar.response_format_from_request).
        Raises `SamplingParamError`.
        """
        from runtime.model.grammar import response_format_from_request

        fields: dict[str, Any] = {"constraint": response_format_from_request(body)}
        names = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty")
        for name in names:
            if body.get(name) is not None:
                fields[name] = body[name]
        for name in ("max_tokens", "max_completion_tokens"):
            if body.get(name) is not None:
                if not isinstance(body[name], int) or isinstance(body[name], bool):
                    raise SamplingParamError(name, "must be an integer")
                if body[name] < 1:
                    raise SamplingParamError(name, "must be at least 1")
                fields["max_tokens"] = body[name]
                break
        stop = body.get("stop")
        if stop is not None:
            fields["stop"] = (stop,) if isinstance(stop, str) else stop
        return cls(**fields)


def _best(scaled: np.ndarray, count: int) -> np.ndarray:
    """Ids of the `count` highest values, best first, ties to the lowest id.

    Uses a partition (O(V)) and sorts only the winners, instead of sorting
    the whole vocabulary.
    """
    size = scaled.shape[0]
    if count < size:
        threshold = np.partition(scaled, size - count)[size - count]
        above = np.flatnonzero(scaled > threshold)
        at = np.flatnonzero(scaled == threshold)[: count - above.shape[0]]
        chosen = np.concatenate([above, at])
    else:
        chosen = np.arange(size)
    # lexsort: last key first; descending value, then ascending id.
    return chosen[np.lexsort((chosen, -scaled[chosen]))]


def _nucleus(scaled: np.ndarray, shifted: np.ndarray, keep: int, top_p: float) -> np.ndarray:
    """Ids of the smallest set of best tokens among the `keep` best whose
    share of those tokens' probability mass reaches `top_p` (at least one)."""
    size = scaled.shape[0]
    mass = shifted[_best(scaled, keep)].sum() if keep < size else shifted.sum()
    count = min(keep, NUCLEUS_FIRST_CANDIDATES)
    while True:
        ids = _best(scaled, count)
        cumulative = np.cumsum(shifted[ids]) / mass
        inside = int(np.searchsorted(cumulative, top_p, side="left")) + 1
        if inside <= count or count == keep:
            return ids[:inside]
        count = min(keep, count * NUCLEUS_GROWTH)


def _checked(logits: np.ndarray) -> np.ndarray:
    values = np.asarray(logits)
    if values.ndim != 1 or values.shape[0] == 0:
        raise ValueError(f"logits must be a non-empty vector, got shape {values.shape}")
    if np.isnan(values).any() or np.isposinf(values).any():
        raise ValueError("logits contain NaN or +inf")
    if np.isneginf(values).all():
        raise ValueError("every token is masked (-inf)")
    return values


class _Draw(NamedTuple):
    """One sampled step: the kept ids (id order) and their Gumbel scores."""

    ids: np.ndarray
    scores: np.ndarray

    def pick(self) -> int:
        return int(self.ids[int(np.argmax(self.scores))])


def _gumbel(seed: int, step: int, size: int) -> np.ndarray:
    """One Gumbel(0, 1) noise per token id, from a generator seeded by
    (seed, step): the same noise for a token whatever else is kept."""
    uniform = np.random.default_rng([seed % SEED_MODULUS, step]).random(size)
    with np.errstate(divide="ignore"):
        return -np.log(-np.log(uniform))  # uniform 0 gives -inf: never drawn


def _kept(values: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Ids the filters keep (top_k, then the nucleus of mass top_p), in id order."""
    scaled = values.astype(np.float64) / params.temperature
    shifted = np.exp(scaled - scaled.max())  # softmax numerators, overflow-free
    size = scaled.shape[0]
    keep = params.top_k if 0 < params.top_k < size else size
    if params.top_p < 1:
        return np.sort(_nucleus(scaled, shifted, keep, params.top_p))
    if keep < size:
        return np.sort(_best(scaled, keep))
    return np.arange(size)


def _draw(values: np.ndarray, params: SamplingParams, seed: int, step: int) -> _Draw:
    """The Gumbel-max trick: the kept token with the highest logit /
    temperature plus its seeded Gumbel noise is a draw from the softmax over
    the kept tokens. Why not a draw on the cumulative mass: there, where a
    token's share sits depends on every other token's, so logits rounded a
    little differently elsewhere move the draw across many tokens; here a
    token wins by a margin in logit units, and a spot check can tell an
    honest draw from a swapped token by that margin (`token_margin`)."""
    ids = _kept(values, params)
    noise = _gumbel(seed, step, values.shape[0])[ids]
    return _Draw(ids, values[ids].astype(np.float64) / params.temperature + noise)


def penalized(
    logits: np.ndarray, params: SamplingParams, history: Sequence[int] = ()
) -> np.ndarray:
    """`logits` less OpenAI's penalties over `history`, the tokens generated
    so far (not the prompt): ``presence_penalty`` once for each token that
    appears in it, ``frequency_penalty`` once per appearance. float64."""
    values = np.asarray(logits, dtype=np.float64)
    if not history or (params.presence_penalty == 0 and params.frequency_penalty == 0):
        return values
    ids = np.asarray(history, dtype=np.int64)
    counts = np.bincount(ids[(ids >= 0) & (ids < values.shape[0])], minlength=values.shape[0])
    penalty = params.presence_penalty * (counts > 0) + params.frequency_penalty * counts
    return values - penalty


def adjusted(
    logits: np.ndarray,
    params: SamplingParams,
    history: Sequence[int] = (),
    allowed: np.ndarray | None = None,
) -> np.ndarray:
    """The logits a draw is made from: checked, penalized over `history`,
    and -inf wherever `allowed` (a boolean vector, the constraint's mask:
    runtime.model.grammar.Matcher.allowed) is False. Raises ValueError as
    `sample` does, and when the mask allows no token."""
    values = penalized(_checked(logits), params, history)
    if allowed is not None:
        if allowed.shape != values.shape:
            raise ValueError(f"mask of shape {allowed.shape} for logits {values.shape}")
        values = np.where(allowed, values, -np.inf)
    return _checked(values)


def sample(
    logits: np.ndarray,
    params: SamplingParams,
    *,
    seed: int,
    step: int,
    history: Sequence[int] = (),
    allowed: np.ndarray | None = None,
) -> int:
    """The token id to emit at generation step `step` (0 for the first token).

    `seed` is `params.seed` when the client sent one, otherwise a per-session
    seed the entry drew when the session opened and keeps for replays; the
    sampler never draws randomness of its own (see the module docstring).
    `history` is the tokens generated before this step (the penalties' input)
    and `allowed` the constraint's mask for it: inputs, never state, so a
    replay that passes the same ones draws the same token.

    Temperature 0 is greedy. Otherwise: logits / temperature, keep the top_k
    best, softmax, keep the nucleus of mass top_p, and draw one token with a
    generator seeded from (seed, step). Raises ValueError for logits that
    are not a non-empty vector or contain NaN or +inf, or where every token
    is masked (-inf): a hop that produced them is broken, and a token drawn
    from them would be garbage.
    """
    values = adjusted(logits, params, history, allowed)
    if params.temperature == 0:
        return int(np.argmax(values))  # the first maximum: ties to the lowest id
    return _draw(values, params, seed, step).pick()


FILTER_SEARCH_STEPS = 20
"""Bisections when `token_margin` looks for the perturbation that moves a
token through the filters: 2**-20 of the logits' range, far below any
tolerance a recipe states."""


def _perturbation_for(
    values: np.ndarray, params: SamplingParams, token: int, keep: bool, within: float = 0.0
) -> float:
    """The smallest perturbation r (each logit moved by at most r) found to
    make the filters keep `token` (``keep``) or drop it, by bisection over r
    (`_kept` is monotone in it along these perturbations). To keep it: it
    and every token below it rise by r, the rest (ties included) fall, so
    it passes whom it can and the mass above it shrinks. To drop it: it
    falls by r, and every token it could be passed by (within 2r below it,
    ties and those above included) rises, the rest fall, so it is passed by
    whom it can be and the mass above it grows."""
    original = values.astype(np.float64)
    own = float(original[token])
    finite = original[np.isfinite(original)]  # masked tokens stay -inf however moved

    def decides(r: float) -> bool:
        rising = original < own if keep else original >= own - 2 * r
        rising[token] = keep
        moved = np.where(rising, original + r, original - r)
        return (token in _kept(moved, params)) == keep

    if decides(within):  # as small as the caller needs it: no closer look
        return within
    low, high = within, float(finite.max() - finite.min()) + 1.0
    for _ in range(FILTER_SEARCH_STEPS):
        middle = (low + high) / 2
        low, high = (low, middle) if decides(middle) else (middle, high)
    return high


def token_margin(
    logits: np.ndarray,
    params: SamplingParams,
    token: int,
    *,
    seed: int,
    step: int,
    history: Sequence[int] = (),
    allowed: np.ndarray | None = None,
) -> float:
    """How much `logits` must be perturbed for `sample` to emit `token`:
    the smallest r found such that moving every logit by at most r (on the
    scale of the largest logit, the doctor's `relative_error` scale) could
    make `token` the draw. 0 when it is the draw already.

    The spot check (`runtime.node.spot_check`) asks this of a recomputed
    step's logits and the token a last hop claimed, and accepts a margin
    within its recipes' tolerance: two honest replicas' logits differ by
    rounding, so a near-tie or a token at the edge of top_k or top_p may
    honestly go the other way; a token no rounding within the tolerance
    explains may not. Greedy: half the claimed token's gap to the best
    logit. Sampled (Gumbel-max, see `_draw`): the claimed token must get
    through the filters, and every kept token whose score beats it must
    either fall behind it (half the score gap, in logits) or be filtered
    out, whichever is nearer. `history` and `allowed` are `sample`'s: the
    penalties and the mask move no logit a replica could round differently,
    and a token the mask forbids is never explained (inf).
    """
    raw = _checked(logits)
    values = adjusted(raw, params, history, allowed)
    if not 0 <= token < values.shape[0] or not math.isfinite(values[token]):
        return math.inf
    scale = max(float(np.abs(raw).max()), 1e-30)
    if params.temperature == 0:
        return float(values.max() - values[token]) / (2 * scale)
    draw = _draw(values, params, seed, step)
    own = float(values[token]) / params.temperature + float(
        _gumbel(seed, step, values.shape[0])[token]
    )
    needed = 0.0 if token in draw.ids else _perturbation_for(values, params, token, keep=True)
    beats = [
        ((score - own) * params.temperature / 2, other)
        for other, score in zip(draw.ids.tolist(), draw.scores.tolist(), strict=True)
        if other != token and score > own
    ]
    for beat, other in sorted(beats, reverse=True):  # the hardest first: the rest rarely matter
        if beat > needed:
            dropped = _perturbation_for(values, params, other, False, within=needed)
            needed = max(needed, min(beat, dropped))
    return needed / scale


def token_logprobs(
    logits: np.ndarray, tokens: Sequence[int], top: int
) -> tuple[np.ndarray, np.ndarray]:
    """OpenAI's logprobs of each row of `logits` [rows, vocab]: the
    log-softmax (float64, of the model's logits before any sampling
    parameter) of the row's token in `tokens`, then of its `top` best
    tokens (ties to the lowest id); those tokens' ids. Returns
    values [rows, 1 + top] and ids [rows, top]."""
    values = np.asarray(logits, dtype=np.float64)
    if values.ndim != 2 or values.shape[0] != len(tokens):
        raise ValueError(f"need one token per row of logits, got {values.shape} and {len(tokens)}")
    peak = values.max(axis=1, keepdims=True)
    logsum = peak + np.log(np.exp(values - peak).sum(axis=1, keepdims=True))
    logprobs = values - logsum
    ids = np.zeros((len(tokens), top), dtype=np.int64)
    for i, row in enumerate(logprobs if top else ()):
        ids[i] = _best(row, top)
    chosen = logprobs[np.arange(len(tokens)), np.asarray(tokens, dtype=np.int64)]
    best = np.take_along_axis(logprobs, ids, axis=1)
    return np.concatenate([chosen[:, None], best], axis=1), ids


class StopResult(NamedTuple):
    """What a `StopScanner.feed` allows out: `text` to emit now, and whether
    a stop sequence ended the generation (`text` then stops right before it)."""

    text: str
    stopped: bool


class StopScanner:
    """Finds stop sequences in streamed text without ever emitting part of one.

    Text arrives in increments (one decoded token at a time) and a stop
    sequence can span several. The scanner holds back the longest tail of
    the text that could still be the start of a stop sequence and releases
    it once it cannot; on a match it releases the text before the match and
    drops the rest, as OpenAI does (the stop sequence is not returned).
    Generation ends as soon as any stop appears, so a longer stop that began
    earlier but is still incomplete then never matches. Anything before the
    held tail cannot start a match, so no match is ever missed.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("stop sequences must be non-empty")
        self._stops = tuple(stops)
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, text: str) -> StopResult:
        """Add decoded text; returns what is safe to emit now. After a stop,
        every further feed returns `("", True)`."""
        if self._stopped:
            return StopResult("", True)
        buffer = self._held + text
        found = [index for stop in self._stops if (index := buffer.find(stop)) >= 0]
        if found:
            self._stopped = True
            self._held = ""
            return StopResult(buffer[: min(found)], True)
        hold = self._prefix_tail(buffer)
        self._held = buffer[len(buffer) - hold :]
        return StopResult(buffer[: len(buffer) - hold], False)

    def flush(self) -> str:
        """The held-back text, when generation ended without a stop (end of
        sequence or max_tokens): it was real output after all."""
        held, self._held = self._held, ""
        return held

    def _prefix_tail(self, buffer: str) -> int:
        """Length of the longest tail of `buffer` that is a proper prefix of a stop."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest
