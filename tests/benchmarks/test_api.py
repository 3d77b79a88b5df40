"""The requests `benchmarks.api` measures are ones the API takes: the same
greedy generation as a chat and as text completions (the measurement itself
runs real processes for a minute: `python -m benchmarks.api`)."""

from __future__ import annotations

from benchmarks.api import bodies
from runtime.inference.chat import parse_chat_request
from runtime.inference.completion import parse_completion_request


def test_each_kind_is_a_valid_request_of_the_same_greedy_generation() -> None:
    kinds = bodies(8)
    chat = parse_chat_request(kinds["chat"][1])
    plain = parse_completion_request(kinds["completions"][1])
    scored = parse_completion_request(kinds["completions_logprobs"][1])
    assert kinds["chat"][0] == "/v1/chat/completions"
    assert kinds["completions"][0] == kinds["completions_logprobs"][0] == "/v1/completions"
    assert chat.params == plain.prompts[0].params == scored.prompts[0].params
    assert chat.params.max_tokens == 8 and chat.params.temperature == 0
    assert scored.prompts[0].logprobs == 5 and scored.prompts[0].echo
