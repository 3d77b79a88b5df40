"""Penalties and structured output through a chain of real hops (issue 32,
items 2 and 4): the last hop masks by the constraint and penalizes over the
tokens generated so far, a failover's new last hop continues from the
`open`'s `generated`, and every seeded sampled run of a JSON schema parses
and validates. Real torch shards of the tiny Qwen3 on ZeroMQ in one process,
as in test_engine.py (whose helpers these tests use).
"""

from __future__ import annotations

import json
from contextlib import aclosing
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import trio
from transformers import AutoTokenizer

from runtime.inference.chain import ChainHop, Failure, Pipeline
from runtime.model.backends.base import ShardBackend
from runtime.model.grammar import json_schema_constraint
from runtime.model.sampling import SamplingParams
from tests.runtime.inference.test_engine import (
    FAST,
    MODEL,
    PROMPT,
    SEED,
    settle,
    start_node,
    torch_shards,
)

__all__ = ["torch_shards"]  # the module-scoped fixture, shared with test_engine's helpers

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["colour", "ok"],
    "additionalProperties": False,
}
"""Short objects (about a dozen tiny-tokenizer tokens): a hundred runs stay cheap."""
RUNS = 100
CONCURRENT = 4  # within a hop's share of sessions per entry (session_policy)
MAX_TOKENS = 32  # past the schema's longest object


def constrained(**fields: Any) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, max_tokens=MAX_TOKENS, constraint=json_schema_constraint(SCHEMA), **fields
    )


async def until_eos(
    pipeline: Pipeline, chain: list[ChainHop], params: SamplingParams, eos: int, **kwargs: Any
) -> list[int]:
    """The tokens before the first end of sequence (the chat entry's rule)."""
    stream = pipeline.generate(
        MODEL, chain, PROMPT, params, seed=kwargs.pop("seed", SEED), **kwargs
    )
    got: list[int] = []
    async with aclosing(stream) as tokens:
        async for token in tokens:
            if token == eos:
                break
            got.append(token)
    return got


async def test_every_seeded_sampled_run_validates_against_the_schema(
    torch_shards: dict[tuple[int, int], ShardBackend], qwen3_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_dir))
    eos = tokenizer.eos_token_id
    texts = set()
    async with trio.open_nursery() as nursery:
        entry = await start_node(nursery, "entry")
        a = await start_node(nursery, "a", torch_shards[(0, 3)])
        b = await start_node(nursery, "b", torch_shards[(3, 6)])
        c = await start_node(nursery, "c", torch_shards[(6, 8)], tokenizer_dir=qwen3_dir)
        chain = [a.as_hop(), b.as_hop(), c.as_hop()]
        params = constrained(presence_penalty=0.5)

        async def run(seeds: range) -> None:
            for seed in seeds:
                pipeline = entry.engine.pipeline
                ids = await until_eos(pipeline, chain, params, eos, seed=seed, deadlines=FAST)
                text = tokenizer.decode(ids)
                jsonschema.validate(json.loads(text), SCHEMA)
                texts.add(text)

        async with trio.open_nursery() as runs:  # a few at once: the hops overlap them
            for start in range(0, RUNS, RUNS // CONCURRENT):
                runs.start_soon(run, range(start, start + RUNS // CONCURRENT))
        assert len(texts) == 6  # sampled: every colour with either truth value
        await settle([a, b, c])
        nursery.cancel_scope.cancel()


async def test_a_failover_keeps_the_constraint_and_penalties(
    torch_shards: dict[tuple[int, int], ShardBackend], qwen3_dir: Path
) -> None:
    """The last hop dies mid-object: the new one rebuilds the grammar and the
    penalties' counts from the open's `generated`, so the text is the one an
    uninterrupted run writes."""
    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_dir))
    eos = tokenizer.eos_token_id
    params = constrained(presence_penalty=1.5, frequency_penalty=0.7)
    kill_after = 6
    async with trio.open_nursery() as nursery:
        entry = await start_node(nursery, "entry")
        a = await start_node(nursery, "a", torch_shards[(0, 3)])
        b = await start_node(nursery, "b", torch_shards[(3, 6)])
        c1 = await start_node(nursery, "c1", torch_shards[(6, 8)], tokenizer_dir=qwen3_dir)
        c2 = await start_node(nursery, "c2", torch_shards[(6, 8)], tokenizer_dir=qwen3_dir)
        pipeline = entry.engine.pipeline
        expected = await until_eos(pipeline, [a.as_hop(), b.as_hop(), c2.as_hop()], params, eos)
        assert len(expected) > kill_after

        failures: list[Failure] = []

        async def reroute(failure: Failure) -> list[ChainHop]:
            failures.append(failure)
            return [a.as_hop(), b.as_hop(), c2.as_hop()]

        stream = pipeline.generate(
            MODEL, [a.as_hop(), b.as_hop(), c1.as_hop()], PROMPT, params, seed=SEED,
            reroute=reroute, deadlines=FAST,
        )  # fmt: skip
        got: list[int] = []
        async with aclosing(stream) as tokens:
            async for token in tokens:
                if token == eos:
                    break
                got.append(token)
                if len(got) == kill_after:
                    c1.stop()
        assert len(failures) == 1 and failures[0].step == kill_after
        assert got == expected
        jsonschema.validate(json.loads(tokenizer.decode(got)), SCHEMA)
        await settle([a, b, c2])
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("tokenizer", [False, True], ids=["no-tokenizer", "bad-constraint"])
async def test_a_constraint_the_hop_cannot_take_is_refused_at_open(
    torch_shards: dict[tuple[int, int], ShardBackend], qwen3_dir: Path, tokenizer: bool
) -> None:
    from runtime.inference.chain import PipelineError

    params = constrained()
    async with trio.open_nursery() as nursery:
        entry = await start_node(nursery, "entry")
        limits = {"tokenizer_dir": qwen3_dir} if tokenizer else {}
        hops = [
            await start_node(nursery, "a", torch_shards[(0, 3)]),
            await start_node(nursery, "b", torch_shards[(3, 6)]),
            await start_node(nursery, "c", torch_shards[(6, 8)], **limits),
        ]
        if tokenizer:  # a schema the entry never sends: an open forged by hand
            object.__setattr__(params.constraint, "schema", "{not json")
        with pytest.raises(PipelineError, match="bad_field"):
            await until_eos(
                entry.engine.pipeline, [h.as_hop() for h in hops], params, -1, deadlines=FAST
            )
        assert hops[2].drops["engine.bad_field"] >= 1
        nursery.cancel_scope.cancel()
