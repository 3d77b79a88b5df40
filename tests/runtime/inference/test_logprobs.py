"""Logprobs from the last hop of a real chain (issue 32, item 1).

Three hops of the tiny model on loopback planes (the nodes of
`tests.runtime.inference.test_engine`) generate with `Logprobs` asked for:
every generated token's logprob and top alternatives, and with `echo` the
prompt's, must equal torch's `log_softmax` of transformers' own logits on
the whole model in fp32 (within 1e-4), through a failover too. The last
hop's fields are checked as it reads them (`logprobs_field`), and the
entry's (`logprob_rows`) refuse what does not fit.
"""

from __future__ import annotations

from contextlib import aclosing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
import trio

from runtime.inference.chain import ChainHop, Failure, Logprobs
from runtime.inference.protocol import (
    MAX_TOP_LOGPROBS,
    BadMessage,
    logprob_header,
    logprob_rows,
    logprobs_field,
    max_logprob_rows,
)
from runtime.model.backends.base import ShardBackend
from tests.runtime.inference.test_engine import (
    FAST,
    GREEDY,
    MODEL,
    PROMPT,
    SAMPLED,
    SEED,
    SPANS,
    collect,
    settle,
    start_chain,
    start_node,
    torch_shards,  # noqa: F401 (a fixture)
)

TOLERANCE = 1e-4
TOP = MAX_TOP_LOGPROBS


def reference_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """torch's log-softmax of transformers' logits for `ids`, fp32: row i
    scores position i + 1."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_rows_match(rows: list[Any], tokens: list[int], reference: torch.Tensor) -> float:
    """Each row against the reference's row for its token; the largest error."""
    worst = 0.0
    assert len(rows) == len(tokens) == reference.shape[0]
    for row, token, expected in zip(rows, tokens, reference, strict=True):
        worst = max(worst, abs(row.logprob - float(expected[token])))
        best = torch.topk(expected, TOP)
        assert list(row.top_ids) == best.indices.tolist() or np.allclose(
            [float(expected[t]) for t in row.top_ids], best.values.numpy(), atol=TOLERANCE
        )
        for token_id, value in zip(row.top_ids, row.top_logprobs, strict=True):
            worst = max(worst, abs(value - float(expected[token_id])))
    assert worst < TOLERANCE
    return worst


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
async def test_the_last_hops_logprobs_equal_torchs_log_softmax(
    torch_shards: dict[tuple[int, int], ShardBackend],  # noqa: F811
    qwen3_dir: Path,
    params: Any,
) -> None:
    async with trio.open_nursery() as nursery:
        entry, hops = await start_chain(nursery, [torch_shards[s] for s in SPANS])
        chain = [node.as_hop() for node in hops]
        record = Logprobs(TOP, echo=True)
        tokens = await collect(entry.engine.pipeline, chain, params=params, logprobs=record)
        await settle(hops)
        nursery.cancel_scope.cancel()
    reference = reference_logprobs(qwen3_dir, [*PROMPT, *tokens])
    assert record.prompt is not None
    assert_rows_match(record.prompt, list(PROMPT[1:]), reference[: len(PROMPT) - 1])
    assert_rows_match(record.tokens, tokens, reference[len(PROMPT) - 1 : -1])
    if params is GREEDY:  # the greedy token is the best alternative
        assert [row.top_ids[0] for row in record.tokens] == tokens


async def test_logprobs_survive_a_failover(
    torch_shards: dict[tuple[int, int], ShardBackend],  # noqa: F811
    qwen3_dir: Path,
) -> None:
    kill_after = 5
    async with trio.open_nursery() as nursery:
        entry = await start_node(nursery, "entry")
        a = await start_node(nursery, "a", torch_shards[(0, 3)])
        b1 = await start_node(nursery, "b1", torch_shards[(3, 6)])
        b2 = await start_node(nursery, "b2", torch_shards[(3, 6)])
        c = await start_node(nursery, "c", torch_shards[(6, 8)])

        async def reroute(failure: Failure) -> list[ChainHop]:
            return [a.as_hop(), b2.as_hop(), c.as_hop()]

        record = Logprobs(2, echo=True)
        stream = entry.engine.pipeline.generate(
            MODEL,
            [a.as_hop(), b1.as_hop(), c.as_hop()],
            PROMPT,
            GREEDY,
            seed=SEED,
            reroute=reroute,
            deadlines=FAST,
            logprobs=record,
        )
        got: list[int] = []
        async with aclosing(stream) as tokens:
            async for token in tokens:
                got.append(token)
                if len(got) == kill_after:
                    b1.stop()
        await settle([a, b2, c])
        nursery.cancel_scope.cancel()
    reference = reference_logprobs(qwen3_dir, [*PROMPT, *got])
    assert record.prompt is not None and len(record.prompt) == len(PROMPT) - 1
    assert len(record.tokens) == len(got)  # one row a token, none twice after the replay
    worst = max(abs(row.logprob - float(reference[len(PROMPT) - 1 + i, t]))
                for i, (row, t) in enumerate(zip(record.tokens, got, strict=True)))  # fmt: skip
    assert worst < TOLERANCE


def test_the_open_field_is_checked_as_the_hop_reads_it() -> None:
    assert logprobs_field({}, 10) is None
    assert logprobs_field({"logprobs": {"top": 2, "echo": [3, 4]}}, 10) == (2, (3, 4))
    many = max_logprob_rows(0) + 1
    for bad, budget in (
        ([2], 10),
        ({"top": 2}, 10),
        ({"top": TOP + 1, "echo": []}, 10),
        ({"top": 1, "echo": [-1]}, 10),
        ({"top": 1, "echo": list(range(11))}, 10),  # over the budget
        ({"top": 0, "echo": [0] * many}, many + 1),  # over one reply
    ):
        with pytest.raises(BadMessage):
            logprobs_field({"logprobs": bad}, budget)


def test_the_reply_fields_round_trip_and_malformed_ones_are_refused() -> None:
    logits = np.random.default_rng(0).normal(size=(4, 30)).astype(np.float32)
    header = logprob_header((2, (7, 8, 9)), 0, logits, 11)
    rows = logprob_rows(header, 2)
    assert len(rows) == 4  # three echoed, then the token's
    assert [len(row.top_ids) for row in rows] == [2] * 4
    assert len(logprob_rows(logprob_header((2, (7, 8, 9)), 4, logits[:1], 11), 2)) == 1
    assert logprob_rows({}, 2) == ()
    for bad in (
        {"lp": header["lp"]},
        {"lp": header["lp"][:-1], "lp_ids": header["lp_ids"]},
        {"lp": np.full(3, 1.0, "<f4").tobytes(), "lp_ids": np.zeros(2, "<i4").tobytes()},
        {"lp": np.full(3, np.nan, "<f4").tobytes(), "lp_ids": np.zeros(2, "<i4").tobytes()},
        {"lp": [0.0], "lp_ids": []},
    ):
        with pytest.raises(BadMessage):
            logprob_rows(bad, 2)
