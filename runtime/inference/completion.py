"""Text completions at the entry: OpenAI's legacy `POST /v1/completions` request.

A completion continues a prompt as it stands, with no chat template: what
base models, evaluation harnesses and models without a template take. This
module parses the request strictly (a bad field is a 400 naming it) into a
`CompletionRequest`: one `PromptCompletion` per prompt (a string, a list of
strings, token ids or a list of those), each of which
`runtime.inference.chat.ChatService.start` generates exactly as it does a
chat (the same routes, quotas, failover and spot checks). `logprobs` (up to
`MAX_TOP_LOGPROBS` alternatives) come from the last hop; `echo` adds the
prompt and, with `logprobs`, its tokens' logprobs. `suffix` is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from runtime.inference.chat import ChatError, ModelTokenizer, checked_model
from runtime.inference.fields import (
    BOOLEAN,
    SAMPLING_FIELDS,
    STREAM_FIELDS,
    TOP_LOGPROBS,
    Field,
)
from runtime.inference.protocol import MAX_TOP_LOGPROBS
from runtime.model.sampling import SamplingParamError, SamplingParams

MAX_PROMPTS: Final = 64
"""Prompts one request may hold; each is a generation of its own, run one after another."""
MAX_PROMPT_CHARS: Final = 1_000_000
"""As a chat message's: bounds the work one request can ask for."""
MAX_PROMPT_TOKENS: Final = 1_000_000


def _bad(message: str, param: str) -> ChatError:
    return ChatError(400, message, param=param, code="invalid_value")


_TOKEN_IDS: Final = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
COMPLETION_FIELDS: Final = (
    Field(
        "prompt",
        {
            "anyOf": [
                {"type": "string", "minLength": 1},
                _TOKEN_IDS,
                {
                    "type": "array",
                    "items": {"anyOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS]},
                    "minItems": 1,
                    "maxItems": MAX_PROMPTS,
                },
            ]
        },
        "a string, token ids, or a list of either: one choice each",
    ),
    *STREAM_FIELDS,
    *SAMPLING_FIELDS,
    Field("echo", BOOLEAN, "the choice's text (and logprobs) start with the prompt's"),
    Field("logprobs", TOP_LOGPROBS, "each token's logprob and this many alternatives"),
    Field("suffix", {"type": "string", "maxLength": 0}, "refused: no insertion mode"),
    Field("best_of", {"type": "integer", "enum": [1]}, "1 only"),
)
"""The fields of a text completion's body, as `check_fields` checks them and
`GET /openapi.json` documents them (`model` and `prompt` required)."""
COMPLETION_REQUIRED: Final = ("model", "prompt")


@dataclass(frozen=True)
class PromptCompletion:
    """One prompt's completion: what `ChatService.start` generates from
    (`runtime.inference.chat.PromptRequest`)."""

    model: str
    prompt: str | tuple[int, ...]
    params: SamplingParams
    logprobs: int | None
    echo: bool
    id_prefix: str = "cmpl"
    prompt_param: str = "prompt"

    def encode(self, tokenizer: ModelTokenizer) -> list[int]:
        if isinstance(self.prompt, str):
            return tokenizer.encode_text(self.prompt)
        outside = [t for t in self.prompt if t >= tokenizer.vocab_size]
        if outside:
            raise _bad(
                f"token {outside[0]} is outside the model's vocabulary of "
                f"{tokenizer.vocab_size} tokens",
                "prompt",
            )
        return list(self.prompt)


@dataclass(frozen=True)
class CompletionRequest:
    """A validated `POST /v1/completions` body."""

    model: str
    prompts: tuple[PromptCompletion, ...]
    stream: bool
    include_usage: bool


def parse_completion_request(body: Mapping[str, Any]) -> CompletionRequest:
    """The validated request, or ChatError(400) naming the first bad field."""
    if body.get("suffix") not in (None, ""):
        raise _bad(
            "suffix (insertion between a prompt and a suffix) is not supported; "
            "send the prompt alone",
            "suffix",
        )
    model = checked_model(body, COMPLETION_FIELDS)
    for name in ("n", "best_of"):
        if body.get(name) not in (None, 1):
            raise _bad(f"only {name}=1 is supported", name)
    prompts = _prompts(body.get("prompt"))
    stream = _flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options must be an object", "stream_options")
    include_usage = _flag(options, "include_usage", "stream_options.include_usage")
    logprobs = body.get("logprobs")
    if logprobs is not None and (
        type(logprobs) is not int or not 0 <= logprobs <= MAX_TOP_LOGPROBS
    ):
        raise _bad(f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}", "logprobs")
    echo = _flag(body, "echo")
    try:
        params = SamplingParams.from_request({**body, "max_tokens": _max_tokens(body)})
    except SamplingParamError as exc:
        raise _bad(str(exc), exc.param) from None
    each = tuple(PromptCompletion(model, p, params, logprobs, echo) for p in prompts)
    return CompletionRequest(model, each, stream, include_usage)


def _max_tokens(body: Mapping[str, Any]) -> object:
    """OpenAI's default for a legacy completion is 16 tokens, not the window."""
    value = body.get("max_tokens")
    return 16 if value is None else value


def _flag(body: Mapping[str, Any], name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if type(value) is not bool:
        raise _bad(f"{param or name} must be true or false", param or name)
    return value


def _prompts(value: object) -> list[str | tuple[int, ...]]:
    """`prompt`: a string, token ids, or a non-empty list of either."""
    if isinstance(value, str):
        return [_text(value, "prompt")]
    if not isinstance(value, list) or not value:
        raise _bad("prompt must be a string, token ids, or a non-empty list of them", "prompt")
    if all(type(t) is int for t in value):
        return [_ids(value, "prompt")]
    if len(value) > MAX_PROMPTS:
        raise _bad(f"at most {MAX_PROMPTS} prompts", "prompt")
    prompts: list[str | tuple[int, ...]] = []
    for i, item in enumerate(value):
        where = f"prompt[{i}]"
        if isinstance(item, str):
            prompts.append(_text(item, where))
        elif isinstance(item, list) and item and all(type(t) is int for t in item):
            prompts.append(_ids(item, where))
        else:
            raise _bad(f"{where} must be a string or a non-empty list of token ids", where)
    return prompts


def _text(value: str, where: str) -> str:
    if not value:
        raise _bad(f"{where} is empty", where)
    if len(value) > MAX_PROMPT_CHARS:
        raise _bad(f"{where} is over {MAX_PROMPT_CHARS} characters", where)
    return value


def _ids(value: Sequence[int], where: str) -> tuple[int, ...]:
    """Token ids (checked against the vocabulary once the model's is known:
    `PromptCompletion.encode`)."""
    if len(value) > MAX_PROMPT_TOKENS:
        raise _bad(f"{where} is over {MAX_PROMPT_TOKENS} tokens", where)
    for i, token in enumerate(value):
        if token < 0:
            raise _bad(f"{where}[{i}] is not a token id: {token}", f"{where}[{i}]")
    return tuple(value)
