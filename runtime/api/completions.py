"""`POST /v1/completions`: OpenAI's legacy text completions, in its shapes.

`runtime.inference.completion` parses the request; each of its prompts is
one generation that `runtime.inference.chat.ChatService.start` runs exactly
as it runs a chat (the same routes, failover, spot checks), one after
another, and `runtime.api.openai.OpenAIRoutes.serve` gives the request its
quota slot and counts how it ended, as it does a chat's. This module only
speaks the shapes: a `text_completion` with one choice per prompt (its
text, the prompt first with `echo`, and its `logprobs`: tokens,
token_logprobs, top_logprobs, text_offset), or server-sent chunks of the
same when `stream` is true, closed by `usage` if asked and `[DONE]`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from runtime.api.openai import (
    Ending,
    OpenAIRoutes,
    Streamed,
    collect,
    shardmesh_json,
    sse,
    stream_error,
    usage_json,
)
from runtime.inference.chat import OUTCOME_OK, ChatError, ChatService, Generation, TokenLogprob
from runtime.inference.completion import (
    CompletionRequest,
    PromptCompletion,
    parse_completion_request,
)

PATH = "/v1/completions"
OBJECT = "text_completion"


def completion_routes(openai: OpenAIRoutes) -> list[Route]:
    """`POST /v1/completions`, served by `openai` (its chat service and quota)."""

    async def completions(request: Request) -> Response:
        return await openai.serve(request, lambda body: respond(openai.chat, body))

    return [Route(PATH, completions, methods=["POST"])]


async def respond(chat: ChatService, body: dict[str, Any]) -> Response | Streamed:
    """The completion of every prompt of `body`: JSON, or a stream's events.
    The first prompt's generation starts here, so that a refusal before
    anything is generated (404, 429, 503, a prompt too long) is the answer's
    status; the others' come in band when the answer streams."""
    request = parse_completion_request(body)
    first = await chat.start(request.prompts[0])
    if request.stream:
        ending = Ending()
        return _events(chat, request, first, ending), ending
    generations, choices = [], []
    started: tuple[Generation, AsyncGenerator[str, None]] | None = first
    for index, prompt in enumerate(request.prompts):
        generation, deltas = started or await chat.start(prompt)
        started = None
        text = await collect(deltas)
        generations.append(generation)
        choices.append(_choice(index, prompt, generation, _echo(prompt, generation) + text))
    return JSONResponse(_answer_json(generations[0], choices, generations))


def _echo(prompt: PromptCompletion, generation: Generation) -> str:
    """The prompt as `echo` shows it: as sent, or decoded when sent as ids."""
    if not prompt.echo:
        return ""
    return prompt.prompt if isinstance(prompt.prompt, str) else generation.prompt_text


def _offset(prompt: PromptCompletion) -> int:
    """Where the first logprob's token starts in the choice's text: the
    completion follows the prompt (OpenAI counts from the prompt's start)."""
    if prompt.echo or not isinstance(prompt.prompt, str):
        return 0
    return len(prompt.prompt)


def _choice(
    index: int, prompt: PromptCompletion, generation: Generation, text: str
) -> dict[str, Any]:
    entries = generation.logprobs
    return {
        "text": text,
        "index": index,
        "logprobs": None if entries is None else logprobs_json(entries, _offset(prompt)),
        "finish_reason": generation.finish_reason,
        "shardmesh": shardmesh_json(generation),
    }


def logprobs_json(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """OpenAI's legacy `logprobs` of `entries`, the first token's text at `offset`."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.text)
    return {
        "tokens": [entry.text for entry in entries],
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [entry.top for entry in entries],
        "text_offset": offsets,
    }


def _answer_json(
    first: Generation, choices: list[dict[str, Any]], generations: list[Generation]
) -> dict[str, Any]:
    return {
        "id": first.id,
        "object": OBJECT,
        "created": first.created,
        "model": first.model,
        "choices": choices,
        "usage": usage_json(generations),
        "shardmesh": shardmesh_json(first),
    }


def _chunk(generation: Generation, choice: dict[str, Any]) -> str:
    return sse(
        {
            "id": generation.id,
            "object": OBJECT,
            "created": generation.created,
            "model": generation.model,
            "choices": [choice],
        }
    )


async def _events(
    chat: ChatService,
    request: CompletionRequest,
    first: tuple[Generation, AsyncGenerator[str, None]],
    ending: Ending,
) -> AsyncGenerator[str, None]:
    """Every prompt's chunks in turn (each with the logprobs of the tokens
    that came since the last), then usage if asked and `[DONE]`; a failure
    ends the stream with an in-band error."""
    generations = []
    started: tuple[Generation, AsyncGenerator[str, None]] | None = first
    try:
        for index, prompt in enumerate(request.prompts):
            generation, deltas = started or await chat.start(prompt)
            started = None
            generations.append(generation)
            async for chunk in _prompt_events(index, prompt, generation, deltas):
                yield chunk
    except ChatError as exc:
        yield stream_error(exc, ending)
        return
    ending.outcome = OUTCOME_OK  # the answer is whole; what follows only closes it
    if request.include_usage:
        last = generations[0]
        usage = {"id": last.id, "object": OBJECT, "created": last.created, "model": last.model}
        yield sse({**usage, "choices": [], "usage": usage_json(generations)})
    yield "data: [DONE]\n\n"


async def _prompt_events(
    index: int,
    prompt: PromptCompletion,
    generation: Generation,
    deltas: AsyncGenerator[str, None],
) -> AsyncGenerator[str, None]:
    """One prompt's chunks: its echo, its deltas, its finish."""
    sent, offset = 0, _offset(prompt)

    def choice(text: str, finish: str | None) -> dict[str, Any]:
        nonlocal sent, offset
        entries = (generation.logprobs or [])[sent:]
        logprobs = None if generation.logprobs is None else logprobs_json(entries, offset)
        sent += len(entries)
        offset += sum(len(entry.text) for entry in entries)
        return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}

    echo = _echo(prompt, generation)
    if echo:
        yield _chunk(generation, choice(echo, None))
    # aclosing: a client that disconnects cancels this generator,
    # and the hops' sessions must close now, not at garbage collection.
    async with aclosing(deltas) as tokens:
        async for delta in tokens:
            yield _chunk(generation, choice(delta, None))
    last = choice("", generation.finish_reason)
    last["shardmesh"] = shardmesh_json(generation)
    yield _chunk(generation, last)
