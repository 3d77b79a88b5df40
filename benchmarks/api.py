"""API benchmark: what a text completion costs per token beside a chat, through real processes.

    python -m benchmarks.api [--json] [--tokens N] [--requests N]

A three-node swarm of the tiny test model on loopback (`--model --layers`,
spans 0:3, 3:6, 6:8) answers the same greedy request as a chat
(`/v1/chat/completions`), as a text completion (`/v1/completions`), and as
a text completion with `echo` and `logprobs` 5, interleaved so drift
cancels. Each answer's `shardmesh.timing.decode_ms_per_token` (the entry's
clock, first token to last) is the figure; the medians' ratios are printed
beside their target. The last line printed is one JSON object; what each
key means: docs/benchmarks.md#api.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import trio

from runtime.cli.localswarm import LocalSwarm
from runtime.model.tiny import make_tiny_model

MODEL = "tiny"
SPANS = ("0:3", "3:6", "6:8")
TEXT = "Tell me about the swarm of volunteers."
TARGET_COMPLETIONS_VS_CHAT = 1.05
"""A text completion's decode step costs at most this much more than a chat's."""
TARGET_JSON_SCHEMA_VS_FREE = 1.1
"""A chat constrained by a JSON schema (the last hop's grammar mask per
token, runtime/model/grammar.py) costs at most this much more per token."""
FREE_TEXT_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
    "additionalProperties": False,
}
"""One free string: the constrained chat runs about as long as the free one."""
READY_TIMEOUT_S = 120.0


def bodies(tokens: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """Each kind of request measured: its path and body."""
    common = {"model": MODEL, "max_tokens": tokens, "temperature": 0}
    messages = [{"role": "user", "content": TEXT}]
    return {
        "chat": ("/v1/chat/completions", {**common, "messages": messages}),
        "completions": ("/v1/completions", {**common, "prompt": TEXT}),
        "chat_json_schema": (
            "/v1/chat/completions",
            {
                **common,
                "messages": messages,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "answer", "schema": FREE_TEXT_SCHEMA},
                },
            },
        ),
        "completions_logprobs": (
            "/v1/completions",
            {**common, "prompt": TEXT, "echo": True, "logprobs": 5},
        ),
    }


async def _per_token_ms(client: httpx.AsyncClient, api: str, path: str, body: Any) -> float:
    answer = await client.post(api + path, json=body)
    if answer.status_code != 200:
        raise RuntimeError(f"{path}: {answer.status_code} {answer.text}")
    ms = answer.json()["shardmesh"]["timing"]["decode_ms_per_token"]
    if ms is None:
        raise RuntimeError(f"{path}: fewer than two tokens; raise --tokens")
    return float(ms)


async def measure(root: Path, tokens: int, requests: int) -> dict[str, list[float]]:
    """Per-token milliseconds of each kind of request, `requests` each, interleaved."""
    model_dir = make_tiny_model(root / "models" / MODEL, layers=8, name=MODEL)
    kinds = bodies(tokens)
    async with LocalSwarm(root / "swarm", profile="local") as swarm:
        nodes = [
            swarm.new_node(args=["--model", str(model_dir), "--layers", span]) for span in SPANS
        ]
        await swarm.start_ready(nodes[0], timeout=60)
        await swarm.start_many(nodes[1:], [nodes[0].seed], timeout=60)

        def ready(views: dict[str, Any]) -> bool:
            coverage = (views[nodes[0].name] or {}).get("coverage", {}).get(MODEL)
            return bool(coverage) and not coverage["gaps"]

        await swarm.wait_for(nodes[:1], ready, READY_TIMEOUT_S, f"{MODEL} served")
        api = nodes[0].api
        figures: dict[str, list[float]] = {kind: [] for kind in kinds}
        async with httpx.AsyncClient(timeout=120) as client:
            for path, body in kinds.values():  # warm-up: tokenizer, caches
                await _per_token_ms(client, api, path, body)
            for _ in range(requests):
                for kind, (path, body) in kinds.items():
                    figures[kind].append(await _per_token_ms(client, api, path, body))
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per request (default 48)")
    parser.add_argument("--requests", type=int, default=9, help="requests of each kind (default 9)")
    args = parser.parse_args(argv)
    if args.tokens < 4 or args.requests < 1:
        parser.error("--tokens must be >= 4 and --requests >= 1")
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardmesh-api-") as tmp:
        figures = trio.run(measure, Path(tmp), args.tokens, args.requests)
    median = {kind: statistics.median(values) for kind, values in figures.items()}
    ratio = round(median["completions"] / median["chat"], 3)
    schema_ratio = round(median["chat_json_schema"] / median["chat"], 3)
    result = {
        "benchmark": "api",
        "completions_vs_chat_per_token": ratio,
        "target_completions_vs_chat_per_token": TARGET_COMPLETIONS_VS_CHAT,
        "meets_completions_target": ratio <= TARGET_COMPLETIONS_VS_CHAT,
        "completions_logprobs_vs_chat_per_token": round(
            median["completions_logprobs"] / median["chat"], 3
        ),
        "json_schema_per_token_vs_free": schema_ratio,
        "target_json_schema_per_token_vs_free": TARGET_JSON_SCHEMA_VS_FREE,
        "meets_json_schema_target": schema_ratio <= TARGET_JSON_SCHEMA_VS_FREE,
        "decode_ms_per_token": {kind: round(ms, 3) for kind, ms in median.items()},
        "tokens": args.tokens,
        "requests": args.requests,
        "wall_s": round(time.perf_counter() - began, 1),
    }
    if not args.json:
        print(f"completions vs chat per token: {ratio} (target <= 1.05)", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
