"""Chat completions at the entry node: parse, tokenize, route, generate, detokenize.

Any node answers `POST /v1/chat/completions` for any model the swarm serves:
it parses the request strictly (a bad field is a 400 naming it), finds the
best-served variant of the model (404 `model_not_found`, or a 503
`model_loading` with the coverage), tokenizes with the model's own tokenizer
(fetched from a serving node and checked against the manifest digest when
this node lacks it), routes and generates through `runtime.inference.chain`
(rerouting around a hop that fails), and detokenizes incrementally, never
showing half a character or part of a stop sequence.

Each step in full: docs/design/inference-protocol.md#chat-at-the-entry.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Protocol

import httpx
import trio

from mesh.coverage import CoverageMap, ModelCoverage
from mesh.identity import node_id_text
from mesh.member_table import MemberState
from mesh.observed_speed import ObservedSpeeds
from mesh.routes import (
    Backoff,
    NoRoute,
    Route,
    RouteInputs,
    find_route,
    network_inputs,
    reroute,
)
from runtime.inference.blame import Contradiction
from runtime.inference.chain import (
    ChainHop,
    ChainTiming,
    Failure,
    Logprobs,
    Pipeline,
    PipelineError,
    Reroute,
)
from runtime.inference.deadlines import expected_pace
from runtime.inference.fields import (
    BOOLEAN,
    SAMPLING_FIELDS,
    STREAM_FIELDS,
    TOP_LOGPROBS,
    Field,
    FieldError,
    check_fields,
)
from runtime.inference.latency import INTER_TOKEN_BUCKETS_S, TTFT_BUCKETS_S, Histogram
from runtime.inference.protocol import MAX_TOP_LOGPROBS, OP_BUSY, LogprobRow, max_logprob_rows
from runtime.inference.swarm import SwarmReader
from runtime.inference.tools import (
    MAX_TOOLS,
    TOOL_CHOICES,
    ToolError,
    Tools,
    forced_call_schema,
    history_calls,
    parse_tools,
    untemplated_chat,
)
from runtime.inference.transcript import Transcript
from runtime.model.manifest import has_chat_template
from runtime.model.sampling import SamplingParamError, SamplingParams, StopScanner

log = logging.getLogger("shardmesh.chat")

ROLES: Final = frozenset({"system", "user", "assistant", "tool", "developer"})
MAX_MESSAGES: Final = 1024
"""More turns than any chat needs; bounds the work one request can ask for."""
MAX_MESSAGE_CHARS: Final = 1_000_000
LOADING_RETRY_AFTER_S: Final = 5
"""What a 503 `model_loading` tells clients to wait: a weight load plus the
doctor take seconds on a small model, and polling faster only adds load."""
REROUTE_WAIT_S: Final = 6.0
"""How long membership gets to declare a hop that went silent (a step ran
out of time before it reported it) suspect or dead, when no chain avoids
it: declared, the generation is lost; still alive, it was only slower than
expected and the generation goes on on the same chain. A killed process is
suspected within a probe round or two (the local profile's 0.3 s probes,
the lan profile's 1 s); a slow one never is."""
REROUTE_POLL_S: Final = 0.05
ARTIFACT_FETCH_TIMEOUT_S: Final = 30.0
HOLD_BACK_REPLACEMENT: Final = "\ufffd"
"""A decoded text ending in U+FFFD is (probably) a UTF-8 sequence cut between
tokens; it is held back until the next token completes it."""


# How a chat request ended (`ChatService.outcomes`; `/metrics`:
# shardmesh_chat_requests_total{outcome}). The API layer counts each request
# once, when it is over: the route for a JSON answer or a refusal, the
# stream when it has ended.
OUTCOME_OK: Final = "ok"
"""Answered to the end (`finish_reason` stop or length)."""
OUTCOME_CLIENT_ERROR: Final = "client_error"
"""Refused for what the request itself says: a malformed body or field, a
body not sent as JSON, a prompt over the model's context window."""
OUTCOME_RATE_LIMITED: Final = "rate_limited"
"""429: the client's or the node's chats in flight (`runtime.api.quota`)."""
OUTCOME_MODEL_NOT_FOUND: Final = "model_not_found"
"""404: no node of the swarm knows the model."""
OUTCOME_MODEL_LOADING: Final = "model_loading"
"""503 before generating: coverage incomplete, no routable chain, or the
tokenizer not to be had from any serving node."""
CHAINS_FULL_RETRY_S: Final = 1
"""What a 429 for full chains tells clients to wait: a hop's sessions free
as generations end, which at tens of tokens a second is seconds."""
OUTCOME_SWARM_LOST: Final = "swarm_lost"
"""A chain failed mid-generation and no re-route saved it."""
OUTCOME_CANCELLED: Final = "cancelled"
"""The client went away (or the node stopped) before the answer was over."""
OUTCOME_SERVER_ERROR: Final = "server_error"
"""Anything else: a bug (500)."""
OUTCOMES: Final = (
    OUTCOME_OK,
    OUTCOME_CLIENT_ERROR,
    OUTCOME_RATE_LIMITED,
    OUTCOME_MODEL_NOT_FOUND,
    OUTCOME_MODEL_LOADING,
    OUTCOME_SWARM_LOST,
    OUTCOME_CANCELLED,
    OUTCOME_SERVER_ERROR,
)
GENERATION_FAILED: Final = "generation_failed"
"""The error code of a generation the swarm lost."""


class ChatError(Exception):
    """A request we answer with an OpenAI-shaped error."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        type_: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.type_ = type_
        self.param = param
        self.headers = headers
        self.extra = extra or {}

    @property
    def outcome(self) -> str:
        """How a request that ends with this error ended (one of `OUTCOMES`)."""
        if self.status == 429:
            return OUTCOME_RATE_LIMITED
        if self.status == 404:
            return OUTCOME_MODEL_NOT_FOUND
        if self.code == GENERATION_FAILED:
            return OUTCOME_SWARM_LOST
        if self.code == "model_loading":
            return OUTCOME_MODEL_LOADING
        return OUTCOME_CLIENT_ERROR if self.status < 500 else OUTCOME_SERVER_ERROR


NO_CHAT_TEMPLATE: Final = "no_chat_template"
"""The 400's code for chat messages to a model that has no chat template."""
NO_TOOL_TEMPLATE: Final = "no_tool_template"
"""The 400's code for `tools` offered to a model whose template ignores them."""


class PromptRequest(Protocol):
    """What `ChatService.start` generates from: a chat's messages
    (`ChatRequest`) or a text completion's prompt
    (`runtime.inference.completion.PromptCompletion`)."""

    @property
    def model(self) -> str: ...
    @property
    def params(self) -> SamplingParams: ...
    @property
    def logprobs(self) -> int | None:
        """How many alternatives each token's logprobs name; None: no logprobs."""
        ...

    @property
    def echo(self) -> bool:
        """Logprobs of the prompt's own tokens too (with `logprobs`)."""
        ...

    @property
    def id_prefix(self) -> str: ...
    @property
    def prompt_param(self) -> str:
        """The request field the prompt came in, for a 400 about its length."""
        ...

    def encode(self, tokenizer: ModelTokenizer) -> list[int]:
        """The prompt's token ids; ChatError(400) when it cannot be encoded."""
        ...


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[dict[str, Any], ...]
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: int | None = None
    """`top_logprobs` when `logprobs` is true (0 without it); None: no logprobs."""
    tools: Tools | None = None
    echo: bool = False
    id_prefix: str = "chatcmpl"
    prompt_param: str = "messages"

    def encode(self, tokenizer: ModelTokenizer) -> list[int]:
        tools = self.tools.functions if self.tools is not None and self.tools.offered else None
        forced = self.tools is not None and self.tools.forces
        return tokenizer.encode_chat(self.messages, tools, forced=forced)


def _bad(message: str, param: str) -> ChatError:
    return ChatError(400, message, param=param, code="invalid_value")


_TEXT_PARTS: Final = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}},
        "required": ["type", "text"],
    },
}
_MESSAGE: Final = {
    "type": "object",
    "properties": {
        "role": {"enum": sorted(ROLES)},
        "content": {"anyOf": [{"type": "string"}, _TEXT_PARTS, {"type": "null"}]},
        "tool_calls": {"type": "array"},
        "tool_call_id": {"type": "string"},
        "name": {"type": "string"},
    },
    "required": ["role"],
}
_TOOL: Final = {
    "type": "object",
    "properties": {
        "type": {"enum": ["function"]},
        "function": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                "description": {"type": "string"},
                "parameters": {"type": "object"},
            },
            "required": ["name"],
        },
    },
    "required": ["type", "function"],
}
CHAT_FIELDS: Final = (
    Field(
        "messages",
        {"type": "array", "items": _MESSAGE, "minItems": 1, "maxItems": MAX_MESSAGES},
        "the chat so far, rendered by the model's own chat template; an assistant "
        "message may carry `tool_calls` (content null), a `tool` message answers one "
        "by `tool_call_id`",
    ),
    *STREAM_FIELDS,
    *SAMPLING_FIELDS,
    Field("max_completion_tokens", {"type": "integer", "minimum": 1}, "max_tokens' newer name"),
    Field("logprobs", BOOLEAN, "each generated token's logprob (`choices[].logprobs.content`)"),
    Field("top_logprobs", TOP_LOGPROBS, "alternatives per token (with `logprobs`: true)"),
    Field(
        "tools",
        {"type": "array", "items": _TOOL, "maxItems": MAX_TOOLS},
        "functions the model may call, rendered by its template (where it has no "
        "place for them: described by the node when tool_choice forces a call, "
        "else a 400 `no_tool_template`)",
    ),
    Field(
        "tool_choice",
        {"anyOf": [{"type": "string", "enum": list(TOOL_CHOICES)}, {"type": "object"}]},
        '"none", "auto", "required" or a named function (the last two make the '
        "answer that call, by constrained decoding)",
    ),
)
"""The fields of a chat body, as `check_fields` checks them and
`GET /openapi.json` documents them (`model` and `messages` required)."""
CHAT_REQUIRED: Final = ("model", "messages")


def checked_model(body: Mapping[str, Any], fields: Sequence[Field]) -> str:
    """`body` checked against its endpoint's field table; its model's name.
    ChatError(400) naming the first bad field."""
    try:
        check_fields(body, fields)
    except FieldError as exc:
        raise _bad(str(exc), exc.param) from None
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model must be a non-empty string", "model")
    return model


def parse_chat_request(body: Mapping[str, Any]) -> ChatRequest:
    """The validated request, or ChatError(400) naming the first bad field."""
    model = checked_model(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty array", "messages")
    if len(messages) > MAX_MESSAGES:
        raise _bad(f"at most {MAX_MESSAGES} messages", "messages")
    try:
        parsed = [_message(message, f"messages[{i}]") for i, message in enumerate(messages)]
        tools = parse_tools(body)
    except ToolError as exc:
        raise _bad(str(exc), exc.param) from None
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if type(stream) is not bool:
        raise _bad("stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options must be an object", "stream_options")
    include_usage = options.get("include_usage", False)
    if type(include_usage) is not bool:
        raise _bad("stream_options.include_usage must be a bool", "stream_options.include_usage")
    if body.get("n") not in (None, 1):
        raise _bad("only n=1 is supported: send one request per choice", "n")
    logprobs = _chat_logprobs(body)
    try:
        params = SamplingParams.from_request(body)
    except SamplingParamError as exc:
        raise _bad(str(exc), exc.param) from None
    if tools is not None:
        params = _forcing_a_call(tools, params)
    return ChatRequest(model, tuple(parsed), params, stream, include_usage, logprobs, tools)


def _forcing_a_call(tools: Tools, params: SamplingParams) -> SamplingParams:
    """`tool_choice` "required" or a named function: the answer constrained
    to that call (`forced_call_schema`), by the last hop's constrained
    decoding as `response_format` is; the two cannot both shape it."""
    from runtime.model.grammar import json_schema_constraint  # llguidance: loaded when used

    schema = forced_call_schema(tools)
    if schema is None:
        return params
    if params.constraint is not None:
        raise _bad(
            "response_format and a tool_choice that forces a call cannot both shape the "
            "answer; send one of them",
            "tool_choice",
        )
    try:
        return replace(params, constraint=json_schema_constraint(schema, "tools"))
    except SamplingParamError as exc:
        raise _bad(str(exc), exc.param) from None


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """`logprobs` and `top_logprobs`: how many alternatives each token names
    (0 to MAX_TOP_LOGPROBS, what the last hop sends; OpenAI allows 20), or
    None when the request wants no logprobs."""
    wanted = body.get("logprobs")
    if wanted is not None and type(wanted) is not bool:
        raise _bad("logprobs must be true or false", "logprobs")
    top = body.get("top_logprobs")
    if top is None:
        return 0 if wanted else None
    if type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise _bad(
            f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS} "
            "(the most alternatives this swarm's last hop sends)",
            "top_logprobs",
        )
    if not wanted:
        raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    return top


def _message(message: object, where: str) -> dict[str, Any]:
    """One history message as chat templates read it: its role and text;
    an assistant's `tool_calls` (its content may be null then) and a tool
    result's `tool_call_id` kept."""
    if not isinstance(message, dict):
        raise _bad(f"{where} must be an object", where)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:  # a list is unhashable
        raise _bad(f"{where}.role must be one of {sorted(ROLES)}", f"{where}.role")
    calls = message.get("tool_calls")
    if role == "assistant" and calls is not None:
        content = message.get("content")
        text = "" if content is None else _content_text(content, where)
        return {
            "role": role,
            "content": text,
            "tool_calls": history_calls(calls, f"{where}.tool_calls"),
        }
    parsed: dict[str, Any] = {"role": role, "content": _content_text(message.get("content"), where)}
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise _bad(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
        parsed["tool_call_id"] = call_id
        if isinstance(message.get("name"), str):
            parsed["name"] = message["name"]
    return parsed


def _content_text(content: object, where: str) -> str:
    """A message's content as text: a string, or OpenAI's list of text parts."""
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _bad(f"{where}.content parts must be text parts", f"{where}.content")
            value = part.get("text")
            if not isinstance(value, str):
                raise _bad(f"{where}.content text must be a string", f"{where}.content")
            parts.append(value)
        text = "".join(parts)
    else:
        raise _bad(f"{where}.content must be a string or text parts", f"{where}.content")
    if len(text) > MAX_MESSAGE_CHARS:
        raise _bad(f"{where}.content is over {MAX_MESSAGE_CHARS} characters", f"{where}.content")
    return text


def import_tokenizer_library() -> Any:
    """transformers' AutoTokenizer: heavy the first time (see
    `ChatService.prepare`), so imported only where chat may be used."""
    from runtime.model.backends import IMPORT_LOCK

    with IMPORT_LOCK:  # transformers' lazy imports are not thread-safe
        from transformers import AutoTokenizer

    return AutoTokenizer


class ModelTokenizer:
    """A model's tokenizer and chat template (transformers' AutoTokenizer)."""

    def __init__(self, directory: Path) -> None:
        from runtime.model.backends import IMPORT_LOCK

        auto = import_tokenizer_library()
        with IMPORT_LOCK:  # from_pretrained resolves more lazy attributes
            self._tok = auto.from_pretrained(str(directory))
        config = _read_json(directory / "config.json")
        generation = _read_json(directory / "generation_config.json")
        eos: set[int] = set()
        for source in (generation.get("eos_token_id"), config.get("eos_token_id")):
            if isinstance(source, int):
                eos.add(source)
            elif isinstance(source, list):
                eos.update(t for t in source if isinstance(t, int))
        if self._tok.eos_token_id is not None:
            eos.add(int(self._tok.eos_token_id))
        self.eos_ids = frozenset(eos)
        self.context_window = int(config.get("max_position_embeddings") or 0) or None
        template = getattr(self._tok, "chat_template", None)
        self.has_chat_template = bool(template)
        self.takes_tools = isinstance(template, str) and template_takes_tools(template)
        self.vocab_size = len(self._tok)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        forced: bool = False,
    ) -> list[int]:
        """The chat's token ids by the model's own template, `tools` rendered
        by it; a 400 naming `/v1/completions` when the model has no template
        (a base model). A template with no place for tools gets the chat
        as text (`untemplated_chat`: the tools described, calls written
        out), but for tools the model would choose among (``forced``
        False): it would not know how to call them, so that is a 400
        naming `tools`."""
        if not self.has_chat_template:
            raise ChatError(
                400,
                "this model has no chat template, so it cannot take chat messages; "
                "send its prompt as text to /v1/completions instead",
                param="messages",
                code=NO_CHAT_TEMPLATE,
            )
        if not self.takes_tools:
            if tools and not forced:
                raise ChatError(
                    400,
                    "this model's chat template has no place for tools, so it cannot "
                    'choose to call one; send tool_choice "required" or a named function '
                    "(the tools are then described to it and its answer is made a call), "
                    "or send the request without tools",
                    param="tools",
                    code=NO_TOOL_TEMPLATE,
                )
            messages, tools = untemplated_chat(messages, tools), None
        ids = self._tok.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        if isinstance(ids, Mapping):  # some transformers versions return a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def encode_text(self, text: str) -> list[int]:
        """A completion's prompt as token ids (with the model's special
        tokens, a BOS where it has one)."""
        return [int(t) for t in self._tok(text)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One token's own text, special tokens included (logprobs name them)."""
        return str(self._tok.decode([token]))


def template_takes_tools(template: str) -> bool:
    """Whether a chat template reads the `tools` variable (transformers
    passes `tools` to every template; one that never reads them would
    drop them silently)."""
    import jinja2
    from jinja2 import meta

    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:  # a tag of transformers' own: read it as text
        return "tools" in template
    return "tools" in meta.find_undeclared_variables(parsed)


def _read_json(path: Path) -> dict[str, Any]:
    import json

    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


class ArtifactStore:
    """Tokenizer files per manifest digest: local model copies first, else
    fetched from a node that serves the model and verified against the
    digest (`runtime.model.manifest.verify_artifacts`)."""

    def __init__(self, cache_dir: Path, local: Callable[[str], Path | None]) -> None:
        """`local` finds this node's own copy of a model by manifest digest."""
        self.cache_dir = cache_dir
        self.local = local
        self._tokenizers: dict[str, ModelTokenizer] = {}
        self._lock = trio.Lock()

    async def tokenizer(self, digest: str, sources: Sequence[str]) -> ModelTokenizer:
        """The tokenizer of the model whose manifest digest is `digest`;
        `sources` are API URLs of nodes serving it, tried in order."""
        async with self._lock:
            found = self._tokenizers.get(digest)
            if found is None:
                directory = self.local(digest) or await self._fetch(digest, sources)
                found = await trio.to_thread.run_sync(ModelTokenizer, directory)
                self._tokenizers[digest] = found
            return found

    def chat_template(self, digest: str) -> bool | None:
        """Whether the model whose manifest digest is `digest` has a chat
        template, where this node knows without a fetch (None otherwise)."""
        found = self._tokenizers.get(digest)
        if found is not None:
            return found.has_chat_template
        local = self.local(digest)
        return None if local is None else has_chat_template(local)

    async def _fetch(self, digest: str, sources: Sequence[str]) -> Path:
        from runtime.model.manifest import ManifestError, artifact_files, verify_artifacts

        target = self.cache_dir / digest
        try:
            verify_artifacts(target, digest)
            return target
        except ManifestError:
            pass
        errors = []
        async with httpx.AsyncClient(timeout=ARTIFACT_FETCH_TIMEOUT_S) as client:
            for url in sources:
                staging = self.cache_dir / f".{digest}.{uuid.uuid4().hex}"
                try:
                    staging.mkdir(parents=True)
                    manifest = await _get(client, f"{url}/v1/network/artifacts/{digest}/manifest")
                    (staging / "shardmesh-manifest.json").write_bytes(manifest)
                    for name in artifact_files(staging):
                        data = await _get(client, f"{url}/v1/network/artifacts/{digest}/{name}")
                        (staging / name).write_bytes(data)
                    verify_artifacts(staging, digest)
                    if target.exists():
                        _remove_tree(target)
                    staging.rename(target)
                    return target
                except (httpx.HTTPError, OSError, ManifestError) as exc:
                    errors.append(f"{url}: {exc}")
                    _remove_tree(staging)
        raise ChatError(
            503,
            "cannot get the model's tokenizer from any serving node: " + "; ".join(errors),
            code="model_loading",
            headers={"Retry-After": str(LOADING_RETRY_AFTER_S)},
        )


async def _get(client: httpx.AsyncClient, url: str) -> bytes:
    response = await client.get(url)
    response.raise_for_status()
    return response.content


def _remove_tree(path: Path) -> None:
    if not path.exists():
        return
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's text and log-probability under the model (the last hop's
    log-softmax of its logits, before any sampling parameter), and its
    `top` alternatives; both None for a prompt's first token, which nothing
    before it predicts."""

    text: str
    logprob: float | None
    top: dict[str, float] | None


@dataclass
class Generation:
    """One completion in progress: what the API layer streams or collects."""

    id: str
    model: str
    created: int
    prompt_tokens: int
    completion_tokens: int = 0
    finish_reason: str | None = None
    route: list[str] = field(default_factory=list)
    reroutes: int = 0
    # Where the time went (`timing_json`): the entry's clock (trio time) for
    # the request and its tokens, and the hops' own clocks for their compute.
    accepted_at: float = 0.0
    first_token_at: float | None = None
    last_token_at: float | None = None
    hops: ChainTiming = field(default_factory=ChainTiming)
    prompt_text: str = ""
    """The prompt as text, when the request echoes it."""
    logprobs: list[TokenLogprob] | None = None
    """Each token's logprobs as they come (the prompt's first with `echo`),
    when the request asked for them."""

    def timing_json(self) -> dict[str, Any]:
        """The response's `shardmesh.timing`: time to the first token and per
        later token as the entry saw them; each hop's compute (the prefill
        that began its chain, and the mean decode step); and what a decode
        step cost beyond the hops' compute (messaging, queues, the entry).
        Hop figures describe the chain that finished the completion; after a
        failover the entry's per-token figure includes the stall."""
        ttft_ms = decode_ms = beyond_ms = None
        first, last = self.first_token_at, self.last_token_at
        if first is not None:
            ttft_ms = (first - self.accepted_at) * 1e3
        if first is not None and last is not None and self.completion_tokens > 1:
            decode_ms = (last - first) / (self.completion_tokens - 1) * 1e3
        chain, steps = self.hops, self.hops.decode_steps
        hops = []
        for node, prefill_us, decode_us in zip(
            chain.nodes, chain.prefill_us, chain.decode_us, strict=True
        ):
            hops.append(
                {
                    "node_id": node,
                    "prefill_ms": _ms(prefill_us / 1e3),
                    "decode_ms_per_step": _ms(decode_us / steps / 1e3) if steps else None,
                }
            )
        if decode_ms is not None and steps:
            beyond_ms = decode_ms - sum(chain.decode_us) / steps / 1e3
        return {
            "ttft_ms": _ms(ttft_ms),
            "decode_ms_per_token": _ms(decode_ms),
            "decode_ms_beyond_compute": _ms(beyond_ms),
            "hops": hops,
        }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


PREPARE_POLL_S: Final = 1.0
"""How often a node that cannot tokenize yet looks for a model in the swarm."""


class ChatSwarm(SwarmReader, Protocol):
    """What chat reads of the swarm beyond a `SwarmReader`: which models are
    assigned, stored and loading, and each member's state and API
    (`runtime.node.swarm_view.SwarmView` is the real one)."""

    def assigned_models(self) -> set[str]: ...
    def stored_models(self) -> set[str]: ...
    def loading_nodes(self, model: str) -> list[str]: ...
    def member_state(self, node: bytes) -> str | None: ...
    def member_api(self, node: bytes) -> str | None: ...
    def rtts(self) -> Mapping[bytes, float]:
        """Member -> the round trip this node measured to it, in seconds."""
        ...


DISTRUSTED: Final = "distrusted"
"""503 code: every holder of a span is distrusted by this entry's checks."""
DISTRUSTED_RETRY: Final = "10"
"""Seconds to wait: about what the leader takes to judge filed evidence."""


def _blocked_span(
    variant: ModelCoverage, distrusted: frozenset[bytes]
) -> tuple[tuple[int, int], list[bytes]] | None:
    """The first span of layers whose every holder is in ``distrusted``,
    and those holders; None when every layer has one trusted holder (or
    none at all: a gap, not distrust)."""
    start: int | None = None
    found: set[bytes] = set()
    for layer in range(variant.num_layers):
        holders = {n.node_id for n in variant.nodes if n.layers[0] <= layer < n.layers[1]}
        if holders and holders <= distrusted:
            start = layer if start is None else start
            found |= holders
        elif start is not None:
            return (start, layer), sorted(found)
    return None if start is None else ((start, variant.num_layers), sorted(found))


class SpotChecks(Protocol):
    """Spot checks of finished generations (`runtime.node.spot_check`)."""

    def consider(self, transcript: Transcript) -> None: ...
    def accuse(self, transcript: Transcript, proof: Contradiction) -> None: ...
    def blocked(self, nodes: Sequence[bytes]) -> str: ...
    def distrusted(self, now: float) -> frozenset[bytes]: ...


class PlacementDesk(Protocol):
    """What chat tells placement and asks of it
    (`runtime.node.placement_driver.Placement` is the real one)."""

    def count_demand(self, model: str, *, unserved: bool) -> None: ...
    def why_waiting(self, model: str) -> tuple[str, str]: ...
    def num_layers(self, model: str) -> int | None: ...


class ChatService:
    """The entry side of chat for one node (see the module docstring)."""

    def __init__(
        self,
        *,
        swarm: ChatSwarm,
        placement: PlacementDesk,
        leader: Callable[[], bytes | None],
        pipeline: Pipeline,
        artifacts: ArtifactStore,
        checks: SpotChecks | None = None,
    ) -> None:
        """`leader` names the Raft leader, if one is known; `pipeline` carries
        this node's generations through chains of hops; `checks` spot-checks
        finished generations and names the hops they caught."""
        self.checks = checks
        self.swarm = swarm
        self.placement = placement
        self._leader = leader
        self._pipeline = pipeline
        self.artifacts = artifacts
        self.backoff = Backoff()
        self.speeds = ObservedSpeeds()  # what each hop's steps took, by this entry
        self.counters: Counter[str] = Counter()  # completions, reroutes, failures
        self.outcomes: Counter[str] = Counter()  # requests by OUTCOMES, counted by the API
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.inter_token = Histogram(INTER_TOKEN_BUCKETS_S)

    def stats_json(self) -> dict[str, Any]:
        """The status document's `chat`: the counters, requests by outcome
        (every outcome, 0 included), and the latency histograms: time to
        first token, and between one token and the next (both by this
        entry's clock, `Generation.timing_json`'s figures for every request)."""
        return {
            **self.counters,
            "requests": {outcome: self.outcomes[outcome] for outcome in OUTCOMES},
            "ttft_s": self.ttft.to_json(),
            "inter_token_s": self.inter_token.to_json(),
        }

    async def prepare(self) -> None:
        """Import the tokenizer library as soon as some member serves or
        loads a model, rather than inside the first chat request this node
        gets: importing transformers' tokenizers costs ~2 s (and ~200 MB),
        which that request's first token would otherwise wait for. A node
        with a torch shard has it loaded already; a light entry pays the
        memory only once the swarm has something to chat with (starting
        while the shards load and run their doctor, so it is done by the
        time they are admitted). Tokenizer *files* are still fetched on the
        first request for a model, never ahead: every node fetching them as
        soon as a model appears would put the whole swarm's downloads on the
        few nodes serving it."""
        while not (self.swarm.coverage().models or self.swarm.assigned_models()):
            await trio.sleep(PREPARE_POLL_S)
        await trio.to_thread.run_sync(import_tokenizer_library)

    # --- models ---------------------------------------------------------------------

    def models(self) -> list[dict[str, Any]]:
        """`GET /v1/models`: every model with complete admitted coverage
        (`ready`), and every model some node is assigned but that cannot be
        routed yet (`loading`); with `chat_template` false for a model that
        takes text completions only (null where this node cannot tell yet)."""
        coverage = self.swarm.coverage()
        listed: dict[str, dict[str, Any]] = {}
        for name in sorted({key.model for key in coverage.models}):
            best = coverage.best(name)
            assert best is not None
            listed[name] = _model_json(name, "ready" if best.complete else "loading", best)
            listed[name]["chat_template"] = self.artifacts.chat_template(best.manifest_digest)
        for name in sorted(self.swarm.assigned_models()):
            listed.setdefault(name, _model_json(name, "loading", None))
        return list(listed.values())

    # --- completions ----------------------------------------------------------------

    async def start(self, request: PromptRequest) -> tuple[Generation, AsyncGenerator[str, None]]:
        """Route and start one completion (of a chat, or of a text prompt);
        the generation record and an iterator of text deltas (the iterator
        sets finish_reason, counts tokens and files their logprobs as it
        goes). Raises ChatError before anything is generated."""
        accepted_at = trio.current_time()
        coverage = self.swarm.coverage()
        try:
            variant = self._servable(coverage, request.model)
            route = self._route(variant, frozenset())
        except ChatError as exc:
            if exc.status == 503:  # demand for a model we cannot serve yet: place it
                self.placement.count_demand(request.model, unserved=True)
            raise
        self.placement.count_demand(request.model, unserved=False)
        tokenizer = await self.artifacts.tokenizer(
            variant.manifest_digest, self._artifact_sources(variant)
        )
        prompt = await trio.to_thread.run_sync(request.encode, tokenizer)
        _check_prompt(request, prompt, tokenizer.context_window)
        generation = Generation(
            id=f"{request.id_prefix}-{uuid.uuid4().hex}",
            model=request.model,
            created=int(time.time()),
            prompt_tokens=len(prompt),
            route=[node_id_text(n) for n in route.node_ids],
            accepted_at=accepted_at,
        )
        if request.echo:
            generation.prompt_text = tokenizer.decode(prompt)
        deltas = self._deltas(request, variant, route, tokenizer, prompt, generation)
        return generation, deltas

    def _servable(self, coverage: CoverageMap, model: str) -> ModelCoverage:
        variant = coverage.best(model)
        known = self.swarm.assigned_models() | self.swarm.stored_models()
        if variant is None and model not in known:
            raise ChatError(
                404,
                f"the model {model!r} does not exist in this swarm",
                code="model_not_found",
                param="model",
            )
        if variant is None or not variant.complete:
            raise self._loading(model, variant, f"the model {model!r} is not fully served yet")
        return variant

    def _loading(self, model: str, variant: ModelCoverage | None, message: str) -> ChatError:
        """A retryable 503 `model_loading` carrying the coverage."""
        return ChatError(
            503,
            message,
            type_="model_loading",
            code="model_loading",
            headers={"Retry-After": str(LOADING_RETRY_AFTER_S)},
            extra={"coverage": self._loading_coverage(model, variant)},
        )

    def _loading_coverage(self, model: str, variant: ModelCoverage | None) -> dict[str, Any]:
        """What a 503 `model_loading` says: covered layers, gaps, who is
        loading, whether a leader is known, and why we are waiting."""
        leader = self._leader()
        code, reason = self.placement.why_waiting(model)
        if leader is None:
            code, reason = "no_leader", "no placement leader is known yet"
        elif code == "no_demand":  # stale by one request: this one was demand
            code, reason = "demand_recorded", "demand was recorded; the leader places it next"
        layers = variant.num_layers if variant else self.placement.num_layers(model)
        return {
            "model": model,
            "layers": layers,
            "covered": [list(s) for s in variant.covered] if variant else [],
            "gaps": [list(s) for s in variant.gaps] if variant else _all_gap(layers),
            "loading": sorted(self.swarm.loading_nodes(model)),
            "leader": node_id_text(leader) if leader else None,
            "waiting_for": code,
            "reason": reason,
        }

    def _route(self, variant: ModelCoverage, avoid: frozenset[bytes]) -> Route:
        inputs = self._route_inputs(avoid, variant)
        found = find_route(variant, inputs)
        if isinstance(found, NoRoute):
            found = self._unblock(variant, avoid) or found
        if isinstance(found, NoRoute):
            message = f"no chain can serve {variant.model!r} now: {found.message}"
            raise self._loading(variant.model, variant, message)
        return found

    def _unblock(self, variant: ModelCoverage, avoid: frozenset[bytes]) -> Route | None:
        """No chain, and this entry's spot checks distrust every holder of a
        span: they ask for verdicts instead of keeping the span dark
        (`SpotChecks.blocked`), and the route is sought again. None when
        distrust is not what blocks; a 503 ``distrusted`` naming the span
        and why when no chain exists even so."""
        if self.checks is None:
            return None
        blocked = _blocked_span(variant, self._distrusted(trio.current_time()))
        if blocked is None:
            return None
        (start, end), holders = blocked
        said = self.checks.blocked(holders)
        log.warning(
            "every holder of %s [%d, %d) is distrusted: %s", variant.model, start, end, said
        )
        found = find_route(variant, self._route_inputs(avoid, variant))
        if isinstance(found, Route):
            return found
        message = (
            f"every node serving layers [{start}, {end}) of {variant.model!r} is distrusted "
            f"by this node's spot checks: {said}"
        )
        raise ChatError(503, message, code=DISTRUSTED, headers={"Retry-After": DISTRUSTED_RETRY})

    def _distrusted(self, now: float) -> frozenset[bytes]:
        return frozenset() if self.checks is None else self.checks.distrusted(now)

    def _route_inputs(self, avoid: frozenset[bytes], variant: ModelCoverage) -> RouteInputs:
        now = trio.current_time()
        return replace(
            network_inputs(self.swarm.node_id, variant, self.swarm.record, self.swarm.rtts()),
            avoid=avoid | self.backoff.avoided(now) | self._distrusted(now),
            observed_step_s=self.speeds.step_s(),
        )

    def _chain(self, route: Route, slowed: Mapping[bytes, float]) -> list[ChainHop]:
        """The pipeline's chain for `route`: each hop's address, and the pace
        its deadlines follow: what this entry observed it take, else what its
        capability report states, `slowed` times slower where a step showed
        it that much slower in this generation (`_reroute`)."""
        step_s, prefill_s = self.speeds.step_s(), self.speeds.prefill_s_per_token()
        chain = []
        for hop in route.hops:
            record = self.swarm.record(hop.node_id)
            if record is None:
                raise ChatError(503, "a routed node has no record", code="model_loading")
            claim = record.capability
            pace = expected_pace(
                claimed_prefill_tokens_per_s=None if claim is None else claim.prefill_tokens_per_s,
                claimed_decode_tokens_per_s=None if claim is None else claim.decode_tokens_per_s,
                observed_prefill_s_per_token=prefill_s.get(hop.node_id),
                observed_step_s=step_s.get(hop.node_id),
            ).slowed(slowed.get(hop.node_id, 1.0))
            address = (self.swarm.dial_addresses(hop.node_id) or record.addresses).data
            chain.append(ChainHop(node_id_text(hop.node_id), address, hop.layers, pace))
        return chain

    def _artifact_sources(self, variant: ModelCoverage) -> list[str]:
        urls = []
        for serving in variant.nodes:
            url = self.swarm.member_api(serving.node_id)
            if url is not None:
                urls.append(url)
        return urls

    async def _deltas(
        self,
        request: PromptRequest,
        variant: ModelCoverage,
        route: Route,
        tokenizer: ModelTokenizer,
        prompt: list[int],
        generation: Generation,
    ) -> AsyncGenerator[str, None]:
        """The completion's text as it is generated, delta by delta, the
        chain rerouted around failures; `generation` keeps the figures.
        Text is held back while it ends in an unfinished UTF-8 sequence or
        may be the start of a stop sequence."""
        slowed: dict[bytes, float] = {}  # hops this generation saw slower than expected
        seed = request.params.seed
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "big")
        scanner = StopScanner(request.params.stop)
        ids: list[int] = []
        emitted = ""
        transcript = Transcript()  # the hops' commitments, for a spot check
        record = None if request.logprobs is None else Logprobs(request.logprobs, request.echo)
        stream = self._pipeline.generate(
            variant.model,
            self._chain(route, slowed),
            prompt,
            request.params,
            seed=seed,
            context_window=tokenizer.context_window,
            reroute=self._failover(variant.model, route, generation, slowed, transcript),
            timing=generation.hops,
            transcript=transcript,
            logprobs=record,
        )
        try:
            async with aclosing(stream) as tokens:
                async for token in tokens:
                    self._time_token(generation)
                    if token in tokenizer.eos_ids:
                        generation.finish_reason = "stop"
                        break
                    ids.append(token)
                    if record is not None:
                        _file_logprobs(generation, record, prompt, token, tokenizer)
                    text = tokenizer.decode(ids)
                    if text.endswith(HOLD_BACK_REPLACEMENT):
                        continue
                    delta, emitted = text[len(emitted) :], text
                    result = scanner.feed(delta)
                    if result.text:
                        yield result.text
                    if result.stopped:
                        generation.finish_reason = "stop"
                        break
        except PipelineError as exc:
            raise self._lost(generation, exc) from exc
        self._finished(generation, transcript)
        if scanner.stopped:
            return
        tail = _held_back(scanner, tokenizer.decode(ids)[len(emitted) :], generation)
        if tail:
            yield tail

    def _failover(
        self,
        model: str,
        route: Route,
        generation: Generation,
        slowed: dict[bytes, float],
        transcript: Transcript,
    ) -> Reroute:
        """The pipeline's `reroute` for one generation: a route around what
        failed (`_reroute`), counted, as a chain; None gives up. A failure
        that came with proof against its hop (`Failure.proof`) goes to the
        spot checks as evidence first (``transcript`` still holds the
        failed chain)."""
        state = {"route": route}

        async def on_failure(failure: Failure) -> list[ChainHop] | None:
            if failure.proof is not None and self.checks is not None:
                self.checks.accuse(transcript, failure.proof)
            new_route = await self._reroute(model, state["route"], failure, slowed)
            if new_route is None:
                return None
            state["route"] = new_route
            self.counters["reroutes"] += 1
            generation.reroutes += 1
            generation.route = [node_id_text(n) for n in new_route.node_ids]
            return self._chain(new_route, slowed)

        return on_failure

    def _time_token(self, generation: Generation) -> None:
        """A token arrived: count it, time it (to first token, or since the last)."""
        generation.completion_tokens += 1
        now = trio.current_time()
        if generation.last_token_at is None:
            generation.first_token_at = now
            self.ttft.observe(now - generation.accepted_at)
        else:
            self.inter_token.observe(now - generation.last_token_at)
        generation.last_token_at = now

    def _lost(self, generation: Generation, exc: PipelineError) -> ChatError:
        """The 503 for a generation no chain could finish, counted and logged;
        a 429 when it never started because every chain's hops were full
        (busy at `open`): the client may simply come back in a moment."""
        if generation.completion_tokens == 0 and exc.failure.reason.startswith(OP_BUSY):
            self.counters["refused_chains_full"] += 1
            return ChatError(
                429,
                f"every chain that serves this model is full ({exc}); try again shortly",
                type_="requests",  # OpenAI's rate-limit error: type "requests"
                code="rate_limit_exceeded",
                headers={"Retry-After": str(CHAINS_FULL_RETRY_S)},
                extra={"reason": "chains_full"},
            )
        self.counters["failed"] += 1
        generation.finish_reason = "error"
        log.warning("generation %s failed: %s", generation.id, exc)
        return ChatError(503, f"the swarm lost this generation: {exc}", code=GENERATION_FAILED)

    def _finished(self, generation: Generation, transcript: Transcript) -> None:
        """A generation ended well: offer it to the spot checks, and learn
        from its timing (routes price hops by what they took, and deadlines
        follow it); it ran to its length unless something stopped it."""
        self.counters["completed"] += 1
        if self.checks is not None:
            self.checks.consider(transcript)
        chain = generation.hops
        nodes = [bytes.fromhex(node) for node in chain.nodes]
        prefilled, wall_s = chain.prefill_tokens, chain.prefill_wall_s
        self.speeds.observe_prefill(nodes, chain.prefill_us, prefilled, wall_s)
        first, last = generation.first_token_at, generation.last_token_at
        if first is not None and last is not None:
            self.speeds.observe(
                nodes,
                chain.decode_us,
                chain.decode_steps,
                wall_s=last - first,
                wall_steps=generation.completion_tokens - 1,
            )
        if generation.finish_reason is None:
            generation.finish_reason = "length"

    async def _reroute(
        self, model: str, route: Route, failure: Failure, slowed: dict[bytes, float]
    ) -> Route | None:
        """A route around what failed: the hops the pipeline holds responsible
        (it names one always: the hop that erred, was busy, did not answer
        `open`, or held a step up past its deadline) and the chain's nodes
        membership no longer sees alive, all of them backed off.

        When a step ran out of time on a hop membership still sees alive and
        no chain avoids it, that hop is only slower than its figures said:
        the generation goes on on the same chain, expecting the hop as many
        times slower as it showed (`slowed`, for `_chain`), and nothing is
        backed off. A hop that went silent (it had not reported the step)
        may be dead instead; membership gets REROUTE_WAIT_S to declare it
        first. A suspect hop of the chain is waited for as long, until it is
        dead (the generation is lost) or refuted (it goes on): a node behind
        NAT whose relay died is suspected, then back at its other relay
        within seconds. Returns None to give up."""
        chain = [n for n in route.node_ids if n != self.swarm.node_id]
        named = {bytes.fromhex(s) for s in failure.suspects}
        declared = self._declared(chain)
        failed = named | declared
        variant = self.swarm.coverage().best(model)
        found: Route | NoRoute | None = None
        if variant is not None:
            found = reroute(variant, route, failed, self._route_inputs(frozenset(failed), variant))
        stall = failure.stall
        if isinstance(found, NoRoute) and stall is not None and not self._gone(chain):
            if stall.silent or declared:
                declared = await self._settled_within(chain, REROUTE_WAIT_S)
                failed |= declared
            if not declared:
                node = bytes.fromhex(stall.node)
                slowed[node] = slowed.get(node, 1.0) * max(stall.slowdown, 1.0)
                log.info(
                    "no chain for %s avoids %s, alive and %.3g times slower than expected "
                    "(%s at step %d): going on on the same chain",
                    model,
                    stall.node[:12],
                    stall.slowdown,
                    failure.reason,
                    failure.step,
                )
                return route
        now = trio.current_time()
        for node in failed:
            self.backoff.record_failure(node, now)
        log.info(
            "re-routing %s around %s (%s at step %d)",
            model,
            ", ".join(node_id_text(n)[:12] for n in failed),
            failure.reason,
            failure.step,
        )
        return found if isinstance(found, Route) else None

    def _declared(self, nodes: Sequence[bytes]) -> set[bytes]:
        """The nodes membership sees suspect or dead (not alive, not unknown)."""
        return {n for n in nodes if self.swarm.member_state(n) not in (MemberState.ALIVE, None)}

    def _gone(self, nodes: Sequence[bytes]) -> set[bytes]:
        """The nodes membership sees dead or left (a suspect may come back)."""
        return {
            n for n in nodes if self.swarm.member_state(n) in (MemberState.DEAD, MemberState.LEFT)
        }

    async def _settled_within(self, nodes: Sequence[bytes], wait_s: float) -> set[bytes]:
        """The nodes membership sees dead, or still suspect, once it has
        settled within `wait_s`: at the first death, at the refutation of
        the last suspect, else when the time is up (empty: none declared)."""
        suspected = False
        with trio.move_on_after(wait_s):
            while not self._gone(nodes):
                declared = self._declared(nodes)
                if suspected and not declared:
                    return set()  # refuted: alive again
                suspected |= bool(declared)
                await trio.sleep(REROUTE_POLL_S)
        return self._declared(nodes)


def _file_logprobs(
    generation: Generation,
    record: Logprobs,
    prompt: Sequence[int],
    token: int,
    tokenizer: ModelTokenizer,
) -> None:
    """File the logprobs of the token just generated (and, before the first,
    the prompt's when echoed) as the client reads them: by token text."""
    filed = generation.logprobs
    if filed is None:
        filed = generation.logprobs = []
    if not filed and record.echo:
        filed.append(TokenLogprob(tokenizer.token_text(prompt[0]), None, None))
        for prompt_token, row in zip(prompt[1:], record.prompt or [], strict=True):
            filed.append(_token_logprob(prompt_token, row, tokenizer))
    filed.append(_token_logprob(token, record.tokens[-1], tokenizer))


def _token_logprob(token: int, row: LogprobRow, tokenizer: ModelTokenizer) -> TokenLogprob:
    """`row` by token text; of alternatives whose texts are alike (byte
    tokens that each decode to U+FFFD) the best is kept."""
    top: dict[str, float] = {}
    for alternative, logprob in zip(row.top_ids, row.top_logprobs, strict=True):
        top.setdefault(tokenizer.token_text(alternative), logprob)  # best first
    return TokenLogprob(tokenizer.token_text(token), row.logprob, top)


def _check_prompt(request: PromptRequest, prompt: Sequence[int], window: int | None) -> None:
    """A 400 for a prompt that cannot be generated from: empty, over the
    model's context window, or too long for its echoed logprobs to fit
    one reply (`runtime.inference.protocol.max_logprob_rows`)."""
    param = request.prompt_param
    if not prompt:
        raise ChatError(400, "the prompt has no tokens", param=param, code="invalid_value")
    if window is not None and len(prompt) >= window:
        raise ChatError(
            400,
            f"the prompt is {len(prompt)} tokens; this model's context window is {window}",
            param=param,
            code="context_length_exceeded",
        )
    top = request.logprobs
    if request.echo and top is not None and len(prompt) - 1 > max_logprob_rows(top):
        raise ChatError(
            400,
            f"echo with logprobs={top} takes prompts of at most "
            f"{max_logprob_rows(top) + 1} tokens; this one is {len(prompt)}",
            param=param,
            code="context_length_exceeded",
        )


def _all_gap(layers: int | None) -> list[list[int]] | None:
    return None if layers is None else [[0, layers]]


def _model_json(name: str, status: str, variant: ModelCoverage | None) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "shardmesh",
        "status": status,
        "manifest_digest": variant.manifest_digest if variant else None,
        "layers": variant.num_layers if variant else None,
        "covered": [list(s) for s in variant.covered] if variant else [],
        "gaps": [list(s) for s in variant.gaps] if variant else None,
        "chat_template": None,
    }


def _held_back(scanner: StopScanner, rest: str, generation: Generation) -> str:
    """What is still held back once generation ended: text held for an
    unfinished UTF-8 sequence that never finished (the decoder's
    replacement character is the answer then), and text held for a
    possible stop sequence that never came (`rest` is the text not yet
    fed); a stop sequence found in it ends the completion there."""
    result = scanner.feed(rest)
    if result.stopped:
        generation.finish_reason = "stop"
    return result.text + ("" if result.stopped else scanner.flush())
