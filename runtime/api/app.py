"""The node's HTTP API (Starlette, served by hypercorn's trio worker).

Every node answers the same API: a client can point at any node.

* `POST /v1/chat/completions` (OpenAI shape; `stream: true` answers with
  server-sent events) and `GET /v1/models`: `runtime.inference.chat` does the work;
* `GET /v1/network/status`, `GET /v1/network/coverage[?model=M]`;
* `POST /v1/network/demand` records chat demand in the placement ledger:
  any node accepts it and forwards it to the Raft leader;
* `GET /v1/network/policy` shows the swarm's placement policy;
  `POST /v1/network/policy` (knob -> value) commits new settings for the
  whole swarm, forwarded to the leader like demand;
* `GET /v1/network/artifacts/{digest}/{file}`: the manifest, config and
  tokenizer files of a model this node holds, for entries that lack them
  (they verify every file against the digest);
* `GET /metrics` (Prometheus text, `runtime.api.metrics`) and `GET /` (a
  dashboard page that polls the status), both views of the status document.
 With `--fault-injection`,
`POST /v1/debug/faults` cuts the node off the control plane for tests. Errors of
every kind, including unknown paths and wrong methods, use OpenAI's error
shape, because the clients that talk to `/v1` are OpenAI clients and they
parse that shape for messages.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import aclosing
from pathlib import Path
from typing import Any, Final, Protocol

import httpx
import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from consensus.ledger import MAX_TEXT, Command, RecordDemand, SetPolicy
from consensus.settings import PlacementSettings, policy_json, settings_error
from mesh.identity import NODE_ID_BYTES, node_id_text
from mesh.records import RECIPES
from runtime.api.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from runtime.api.metrics import prometheus_text
from runtime.inference.chat import ChatError, ChatService, Generation, parse_chat_request
from runtime.model.manifest import MANIFEST_FILE, ManifestError, artifact_files
from runtime.model.store import ModelStore
from runtime.node.placement_driver import AlreadyAssigned, Placement
from runtime.node.raft_driver import NotLeader, ProposalFailed, RaftDriver

log = logging.getLogger("shardmesh.api")

FORWARDED_HEADER: Final = "x-shardmesh-forwarded-by"
"""Set on a request one node forwards to the leader. A forwarded request is
never forwarded again: if leadership moved meanwhile, the caller gets a 503
and retries, instead of the request bouncing between nodes."""
FORWARD_TIMEOUT_S: Final = 10.0
"""A forwarded proposal waits for its commit on the leader; this covers the
leader's own proposal timeout plus a round trip."""
MAX_DEMAND_COUNT: Final = 1_000_000
"""One report's count; larger is a client bug, not demand."""
DASHBOARD: Final = Path(__file__).with_name("dashboard.html")
"""The page `GET /` serves: static, it reads `/v1/network/status` itself."""
MAX_BODY_BYTES: Final = 64 * 1024
"""Control-plane request bodies are tiny; refuse megabytes before parsing."""


class NodeAPI(Protocol):
    """What the API needs from a node (`runtime.node.daemon.Node` is the real one)."""

    raft: RaftDriver
    chat: ChatService
    placement: Placement
    store: ModelStore
    fault_injection: bool
    isolated: bool

    def status(self) -> dict[str, Any]: ...

    def member_api(self, node: bytes) -> str | None: ...

    def artifact_path(self, digest: str) -> Path | None: ...


_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    422: "invalid_request_error",
    503: "service_unavailable",
}
_ERROR_CODES = {404: "not_found", 405: "method_not_allowed", 500: "internal_error"}


def error_response(
    status: int,
    message: str,
    *,
    type_: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    """An error in OpenAI's shape: `{"error": {"message", "type", "code"}}`
    (plus `param`, which OpenAI clients expect to find, and any `extra`)."""
    body: dict[str, Any] = {
        "message": message,
        "type": type_ or _ERROR_TYPES.get(status, "server_error" if status >= 500 else "error"),
        "param": None,
        "code": code if code is not None else _ERROR_CODES.get(status),
    }
    body.update(extra)  # e.g. param="model"
    return JSONResponse({"error": body}, status_code=status, headers=headers)


class BadRequest(Exception):
    """A request body we refuse; becomes a 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


async def json_object(request: Request) -> dict[str, Any]:
    """The request body as a JSON object, or BadRequest saying what is wrong."""
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        raise BadRequest(f"request body over {MAX_BODY_BYTES} bytes")
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"malformed JSON body: {exc}") from None
    if not isinstance(value, dict):
        raise BadRequest("the body must be a JSON object")
    return value


def _bootstrap_fields(body: dict[str, Any]) -> tuple[bytes, str, tuple[int, int], str]:
    """(node, model, layers, recipe) of a `POST /v1/nodes/assign` body."""
    try:
        node_id = bytes.fromhex(body.get("node_id", ""))
    except (TypeError, ValueError):
        node_id = b""
    if len(node_id) != NODE_ID_BYTES:
        raise BadRequest("node_id must be a node's 64-hex-digit id", "node_id")
    model = body.get("model")
    if not isinstance(model, str) or not 0 < len(model) <= MAX_TEXT:
        raise BadRequest(f"model must be a non-empty string of <= {MAX_TEXT} chars", "model")
    layers = body.get("layers")
    if (
        not isinstance(layers, list)
        or len(layers) != 2
        or not all(type(x) is int for x in layers)
        or not 0 <= layers[0] < layers[1]
    ):
        raise BadRequest("layers must be [a, b] with 0 <= a < b", "layers")
    recipe = body.get("recipe", "fp32")
    if recipe not in RECIPES:
        raise BadRequest(f"recipe must be one of {sorted(RECIPES)}", "recipe")
    return node_id, model, (layers[0], layers[1]), recipe


def _demand_command(body: dict[str, Any]) -> RecordDemand:
    model = body.get("model")
    if not isinstance(model, str) or not 0 < len(model) <= MAX_TEXT:
        raise BadRequest(f"model must be a non-empty string of <= {MAX_TEXT} chars", "model")
    count = body.get("count", 1)
    if type(count) is not int or not 1 <= count <= MAX_DEMAND_COUNT:
        raise BadRequest(f"count must be an integer in [1, {MAX_DEMAND_COUNT}]", "count")
    return RecordDemand(model=model, count=count, at=time.time())


def _policy_command(body: dict[str, Any], current: PlacementSettings) -> SetPolicy:
    """The SetPolicy of a `POST /v1/network/policy` body: each knob checked
    alone (a 400 naming it), then all of them with the settings in force."""
    if not body:
        raise BadRequest('name at least one setting, e.g. {"idle_release_s": 600}')
    for name, value in body.items():
        error = settings_error({name: value}, PlacementSettings())
        if error is not None:
            raise BadRequest(error, name)
    error = settings_error(body, current)
    if error is not None:
        raise BadRequest(f"with the settings in force: {error}")
    return SetPolicy(tuple(sorted(body.items())), time.time())


def _chat_error(exc: ChatError) -> JSONResponse:
    extra = dict(exc.extra)
    if exc.param is not None:
        extra["param"] = exc.param
    return error_response(
        exc.status, exc.message, type_=exc.type_, code=exc.code, headers=exc.headers, **extra
    )


def _completion_json(generation: Generation, text: str) -> dict[str, Any]:
    return {
        "id": generation.id,
        "object": "chat.completion",
        "created": generation.created,
        "model": generation.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": generation.finish_reason,
            }
        ],
        "usage": _usage(generation),
        "shardmesh": _shardmesh_json(generation),
    }


def _shardmesh_json(generation: Generation) -> dict[str, Any]:
    """Our extension to a completion (OpenAI clients ignore unknown fields):
    the chain it ran through, its failovers, and where its time went."""
    return {
        "route": generation.route,
        "reroutes": generation.reroutes,
        "timing": generation.timing_json(),
    }


def _usage(generation: Generation) -> dict[str, int]:
    return {
        "prompt_tokens": generation.prompt_tokens,
        "completion_tokens": generation.completion_tokens,
        "total_tokens": generation.prompt_tokens + generation.completion_tokens,
    }


def _chunk(generation: Generation, delta: dict[str, Any], finish: str | None) -> str:
    return f"data: {json.dumps(_chunk_json(generation, delta, finish))}\n\n"


def _chunk_json(
    generation: Generation, delta: dict[str, Any], finish: str | None
) -> dict[str, Any]:
    return {
        "id": generation.id,
        "object": "chat.completion.chunk",
        "created": generation.created,
        "model": generation.model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def create_app(node: NodeAPI) -> Starlette:
    """The ASGI app for one node."""

    async def chat_completions(request: Request) -> Response:
        try:
            chat = parse_chat_request(await json_object(request))
        except BadRequest as exc:
            return error_response(400, str(exc), param=exc.param)
        except ChatError as exc:
            return _chat_error(exc)
        try:
            generation, deltas = await node.chat.start(chat)
        except ChatError as exc:
            return _chat_error(exc)
        if not chat.stream:
            try:
                async with aclosing(deltas):
                    text = "".join([delta async for delta in deltas])
            except ChatError as exc:
                return _chat_error(exc)
            return JSONResponse(_completion_json(generation, text))

        async def events() -> Any:
            # aclosing: a client that disconnects cancels this generator,
            # and the hops' sessions must close now, not at garbage collection.
            yield _chunk(generation, {"role": "assistant", "content": ""}, None)
            try:
                async with aclosing(deltas):
                    async for delta in deltas:
                        yield _chunk(generation, {"content": delta}, None)
            except ChatError as exc:
                # Headers are gone: report in-band, as OpenAI does mid-stream.
                error = {"message": exc.message, "type": "server_error", "code": exc.code}
                yield f"data: {json.dumps({'error': error})}\n\n"
                return
            last = _chunk_json(generation, {}, generation.finish_reason)
            last["shardmesh"] = _shardmesh_json(generation)
            yield f"data: {json.dumps(last)}\n\n"
            if chat.include_usage:
                usage = {
                    "id": generation.id,
                    "object": "chat.completion.chunk",
                    "created": generation.created,
                    "model": generation.model,
                    "choices": [],
                    "usage": _usage(generation),
                }
                yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def network_assign(request: Request) -> JSONResponse:
        """Bootstrap: the best gap for a joining node, by its memory and store."""
        try:
            body = await json_object(request)
            memory = body.get("memory_bytes")
            if type(memory) is not int or memory < 0:
                raise BadRequest("memory_bytes must be a non-negative integer", "memory_bytes")
            models = body.get("models")
            if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
                raise BadRequest("models must be an array of model names", "models")
        except BadRequest as exc:
            return error_response(400, str(exc), param=exc.param)
        gap = node.placement.suggest(memory, models)
        if gap is None:
            return error_response(
                404, "no gap of these models fits this node; stay spare", code="no_gap"
            )
        return JSONResponse(
            {
                "model": gap.model,
                "layers": list(gap.layers),
                "recipe": gap.recipe,
                "demand_per_min": gap.demand_per_min,
            }
        )

    async def nodes_assign(request: Request) -> JSONResponse:
        """An operator (or `--auto-join`) assigns a node on its first join."""
        try:
            body = await json_object(request)
            command = node.placement.bootstrap_command(*_bootstrap_fields(body))
        except BadRequest as exc:
            return error_response(400, str(exc), param=exc.param)
        except AlreadyAssigned as exc:
            return error_response(409, str(exc), code="already_assigned", param="node_id")
        return await commit(request, command)

    async def model_manifest(request: Request) -> Response:
        stored = node.store.get(request.path_params["name"])
        if stored is None:
            return error_response(404, "this node's store has no such model", code="not_found")
        return FileResponse(stored.path / MANIFEST_FILE, media_type="application/json")

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": node.chat.models()})

    async def artifact(request: Request) -> Response:
        digest = request.path_params["digest"]
        name = request.path_params["name"]
        directory = node.artifact_path(digest)
        if directory is None:
            return error_response(404, f"this node holds no model with digest {digest}")
        if name == "manifest":
            name = MANIFEST_FILE
        else:
            try:
                allowed = await trio.to_thread.run_sync(artifact_files, directory)
            except ManifestError as exc:
                return error_response(500, str(exc))
            if name not in allowed:
                return error_response(404, f"{name!r} is not a shareable file of this model")
        return FileResponse(directory / name, media_type="application/octet-stream")

    async def commit(request: Request, command: Command) -> JSONResponse:
        """Propose `command` here if we lead, else forward the request to
        the leader once; answer with where it committed."""
        try:
            committed = await node.raft.propose(command)
        except NotLeader as exc:
            return await forward_to_leader(request, exc)
        except ProposalFailed as exc:
            return error_response(
                503, str(exc), code="proposal_failed", headers={"Retry-After": "1"}
            )
        reply = {
            "index": committed.index,
            "term": committed.term,
            "accepted": committed.accepted,
            "reason": committed.reason or None,
            "detail": committed.detail or None,
            "leader": node_id_text(node.raft.node_id),
        }
        if isinstance(command, SetPolicy):  # applied here: the swarm's policy from now on
            reply["policy"] = policy_json(node.raft.ledger.policy())
            reply["settings"] = node.raft.ledger.policy_settings()
        return JSONResponse(reply)

    async def forward_to_leader(request: Request, exc: NotLeader) -> JSONResponse:
        leader = exc.leader
        url = node.member_api(leader) if leader is not None else None
        if url is None or request.headers.get(FORWARDED_HEADER):
            return error_response(
                503,
                str(exc),
                code="no_leader" if leader is None else "not_leader",
                headers={"Retry-After": "1"},
                leader=node_id_text(leader) if leader else None,
            )
        try:
            async with httpx.AsyncClient(timeout=FORWARD_TIMEOUT_S) as client:
                reply = await client.post(
                    url + request.url.path,
                    content=await request.body(),
                    headers={
                        "content-type": "application/json",
                        FORWARDED_HEADER: node_id_text(node.raft.node_id),
                    },
                )
            body = reply.json()
        except (httpx.HTTPError, ValueError) as err:
            return error_response(
                503,
                f"the leader {node_id_text(leader)} did not answer: {err}",
                code="leader_unreachable",
                headers={"Retry-After": "1"},
            )
        return JSONResponse(body, status_code=reply.status_code)

    async def network_demand(request: Request) -> JSONResponse:
        try:
            command = _demand_command(await json_object(request))
        except BadRequest as exc:
            return error_response(400, str(exc), param=exc.param)
        return await commit(request, command)

    async def network_policy(request: Request) -> JSONResponse:
        ledger = node.raft.ledger
        if request.method == "GET":
            return JSONResponse(
                {"policy": policy_json(ledger.policy()), "settings": ledger.policy_settings()}
            )
        try:
            command = _policy_command(await json_object(request), ledger.policy())
        except BadRequest as exc:
            return error_response(400, str(exc), param=exc.param)
        return await commit(request, command)

    async def debug_faults(request: Request) -> JSONResponse:
        if not node.fault_injection:
            return error_response(404, "fault injection is off (start with --fault-injection)")
        try:
            body = await json_object(request)
            isolate = body.get("isolate")
            if type(isolate) is not bool:
                raise BadRequest("isolate must be true or false", "isolate")
        except BadRequest as exc:
            return error_response(400, str(exc), param=exc.param)
        node.isolated = isolate
        log.warning("fault injection: control plane %s", "cut" if isolate else "restored")
        return JSONResponse({"isolated": node.isolated})

    async def network_status(request: Request) -> JSONResponse:
        return JSONResponse(node.status())

    async def metrics(request: Request) -> Response:
        return Response(prometheus_text(node.status()), media_type=METRICS_CONTENT_TYPE)

    async def dashboard(request: Request) -> Response:
        return FileResponse(DASHBOARD, media_type="text/html; charset=utf-8")

    async def network_coverage(request: Request) -> JSONResponse:
        coverage = node.status()["coverage"]
        model = request.query_params.get("model")
        if model is None:
            return JSONResponse(coverage)
        if model not in coverage:
            return error_response(
                404,
                f"no node reports an admitted capability for model {model!r}",
                code="model_not_found",
                param="model",
            )
        return JSONResponse({model: coverage[model]})

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, message, headers=exc.headers)

    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}")

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/network/artifacts/{digest}/{name}", artifact, methods=["GET"]),
            Route("/v1/network/models/{name}/manifest", model_manifest, methods=["GET"]),
            Route("/v1/network/status", network_status, methods=["GET"]),
            Route("/v1/network/coverage", network_coverage, methods=["GET"]),
            Route("/v1/network/demand", network_demand, methods=["POST"]),
            Route("/v1/network/policy", network_policy, methods=["GET", "POST"]),
            Route("/v1/network/assign", network_assign, methods=["POST"]),
            Route("/v1/nodes/assign", nodes_assign, methods=["POST"]),
            Route("/v1/debug/faults", debug_faults, methods=["POST"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/", dashboard, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
    )
