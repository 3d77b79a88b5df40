"""`shardmesh chat`: one streaming chat completion from any node, printed as it arrives.

While the swarm is still placing or loading the model, it keeps asking (for
`--wait` seconds), saying on stderr what it waits for; at the end, one line
on stderr gives the finish reason, the token counts and, when the node sent
them, where the time went (`shardmesh.timing`).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Final

from runtime.cli import argtypes
from runtime.cli.command import PROG, Commands, fail
from runtime.cli.flags import api_flag

if TYPE_CHECKING:
    from runtime.cli.chat_client import ChatResult, ModelLoading

CHAT_WAIT_S: Final = 300.0
"""How long `chat` keeps asking while the swarm places and loads the model:
the request is the demand that gets it placed, and a model of a few GB
takes minutes to load on a volunteer's disk. Each wait prints why."""


def register(commands: Commands) -> None:
    chat = commands.add_parser(
        "chat",
        help="stream a chat answer from the swarm",
        description="POST one streaming chat completion to a node and print it as it arrives.",
    )
    api_flag(chat, "any node's API")
    chat.add_argument("--model", required=True, metavar="NAME", help="the model's name")
    chat.add_argument("prompt", metavar="PROMPT", help="the user message")
    chat.add_argument(
        "--max-tokens", type=int, default=None, metavar="N", help="most tokens to generate"
    )
    chat.add_argument(
        "--temperature", type=float, default=None, metavar="T", help="sampling temperature"
    )
    chat.add_argument(
        "--seed", type=int, default=None, metavar="S", help="sampling seed (same seed, same text)"
    )
    chat.add_argument(
        "--wait",
        type=argtypes.seconds,
        default=CHAT_WAIT_S,
        metavar="SECONDS",
        help=(
            "while the swarm is still placing or loading the model, keep asking for this "
            f"long, showing its progress (default {CHAT_WAIT_S:.0f}; 0: fail at once)"
        ),
    )
    chat.set_defaults(run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import trio  # with httpx, only when a chat is sent

    from runtime.cli.chat_client import ChatClientError, stream_chat

    try:
        result = trio.run(
            lambda: stream_chat(
                args.api,
                args.model,
                args.prompt,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                seed=args.seed,
                on_text=_show,
                wait_s=args.wait,
                on_wait=_waiting,
            )
        )
    except ChatClientError as exc:
        return fail("chat", str(exc))
    print()
    if result.usage:
        print(
            f"[{result.finish_reason}; {result.usage['prompt_tokens']} prompt + "
            f"{result.usage['completion_tokens']} completion tokens{chat_timing(result)}]",
            file=sys.stderr,
        )
    return 0


def _show(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _waiting(loading: ModelLoading, retry_in: float) -> None:
    from runtime.cli.chat_client import describe_loading

    print(
        f"{PROG} chat: waiting for {describe_loading(loading)} (asking again in {retry_in:.0f} s)",
        file=sys.stderr,
        flush=True,
    )


def chat_timing(result: ChatResult) -> str:
    """ "; first token 28 ms, 9.1 ms/token through 3 hops", from the final
    chunk's `shardmesh.timing`, or nothing if the server sent no such figures
    (another OpenAI server, or a one-token answer)."""
    timing = (result.shardmesh or {}).get("timing")
    if not isinstance(timing, dict):
        return ""
    ttft, per_token, hops = (timing.get(k) for k in ("ttft_ms", "decode_ms_per_token", "hops"))
    if not (isinstance(ttft, int | float) and isinstance(per_token, int | float)):
        return ""
    through = f" through {len(hops)} hop{'s' * (len(hops) != 1)}" if isinstance(hops, list) else ""
    return f"; first token {ttft:.0f} ms, {per_token:.1f} ms/token{through}"
