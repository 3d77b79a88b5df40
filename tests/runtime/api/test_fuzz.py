"""No input makes the API answer 500: a property-based fuzz of every route (issue 30, item 6).

The node's whole app (`runtime.api.app.create_app`: chat, the network routes,
the page) runs on an `ApiNode` (tests/runtime/api/inprocess.py) that leads its
one-voter Raft, with a real chat entry, in a trio run on a thread of its own,
so that each of hypothesis' examples (a plain function) makes one request
through it. Every route is fuzzed, by its own methods and others: arbitrary
JSON (deep nesting, lone surrogates, integers past 64 bits, NaN and Infinity
written as tokens, raw surrogates as invalid UTF-8), objects of the fields
the routes read holding values of every type, arbitrary bytes, any content
type, with the operator's token, a live member's signature, a stranger's,
or none, under a few Host names. No answer is a 5xx but a 503 with
Retry-After, and every 4xx is in OpenAI's error shape. The examples are
derandomized: the same few hundred each run, in a few seconds.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from dataclasses import fields
from functools import cache, partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast
from urllib.parse import quote

import httpx
import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.routing import Route

from consensus.settings import PlacementSettings
from mesh.identity import Identity, node_id_text
from runtime.api.app import NodeAPI, create_app
from runtime.api.http import MAX_JSON_DEPTH
from runtime.inference.commitment import SKETCH_DIMS, Commitment, ids_digest
from runtime.model.sampling import SamplingParams
from runtime.node.direct_paths import PUNCH_PATH
from runtime.node.spot_check import EVIDENCE_PATH, Evidence
from tests.runtime.api.inprocess import TOKEN, ApiNode, chat_service, leading_node

NOT_FUZZED = {
    "/metrics": "renders the status document, which `ApiNode` does not build "
    "(tests/runtime/api/test_metrics.py renders real ones); it reads no input"
}
"""Routes left out, each with why."""
BODIES_PER_ROUTE = 30
"""Bodies POSTed to each route past its gate: enough to reach each field's
check with kinds of value it does not take (about 0.3 s a route, mostly
hypothesis' own drawing)."""
ENVELOPES_PER_ROUTE = 10
"""Methods, headers and parameters tried on each route: most are refused
before a body is read, so fewer are needed."""
BOUNDED = settings(
    derandomize=True,  # the same examples each run: a failure is reproduced by rerunning
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
BODY_FUZZ = settings(BOUNDED, max_examples=BODIES_PER_ROUTE)
ENVELOPE_FUZZ = settings(BOUNDED, max_examples=ENVELOPES_PER_ROUTE)
JSON_TYPE = "application/json"
MEMBER_REPORTS = frozenset({"/v1/network/demand", EVIDENCE_PATH, PUNCH_PATH})
"""The routes that take a live member's signed call, not the operator's token."""
MEMBER = Identity.generate()
STRANGER = Identity.generate()
FIELDS = sorted(
    {
        *("model", "messages", "role", "content", "type", "text", "stream", "stream_options"),
        *("include_usage", "n", "temperature", "top_p", "top_k", "seed", "max_tokens", "stop"),
        *("max_completion_tokens", "memory_bytes", "models", "node_id", "layers", "recipe"),
        *("count", "invitation", "at", "signature", "voter", "expires_s", "uses", "isolate"),
        *("reporter", "kind", "hop_index", "prompt", "tokens", "sampling", "commitment"),
        *("plane", "method", "host", "port"),
        *("links", "pos", "entry", "digest", "echo", "logprobs", "suffix", "best_of"),
        *(knob.name for knob in fields(PlacementSettings)),
    }
)
"""The names the routes read, so that objects reach each field's own check."""


class Portal:
    """The app in a trio run on its own thread; `request` makes one call
    from the test's thread and waits for its answer."""

    def __init__(self, tmp: Path) -> None:
        self._tmp = tmp
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Portal:
        self._thread.start()
        self._ready.wait(30)
        if self._failure is not None:
            raise self._failure
        return self

    def __exit__(self, *exc: object) -> None:
        trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(10)

    def _run(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # reported by __enter__ when it never got ready
            self._failure = exc
            self._ready.set()

    async def _serve(self) -> None:
        async with leading_node(self._tmp, fault_injection=True) as node:
            node.chat = chat_service(node, self._tmp / "tokenizers")
            node.members.add(MEMBER.node_id)
            self.node: ApiNode = node
            self.app = create_app(cast(NodeAPI, node))
            transport = httpx.ASGITransport(app=self.app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
                self.client = c
                self._token = trio.lowlevel.current_trio_token()
                self._stop = trio.Event()
                self._ready.set()
                await self._stop.wait()

    def request(self, method: str, url: str, body: bytes, headers: dict[str, str]) -> Any:
        call = partial(self.client.request, method, url, content=body, headers=headers)
        return trio.from_thread.run(call, trio_token=self._token)


@pytest.fixture(scope="module")
def portal(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Portal]:
    with Portal(tmp_path_factory.mktemp("fuzz")) as running:
        yield running


def routes_of(app: Any) -> list[Route]:
    return [r for r in app.routes if isinstance(r, Route) and r.path not in NOT_FUZZED]


def route_paths() -> list[tuple[str, frozenset[str]]]:
    """Every path of the app with its methods, so that a new route is fuzzed
    by itself. The app is made of a bare stand-in (collection starts no
    node): `create_app` reads nothing of its node but `chat` until a request
    comes."""
    app = create_app(cast(NodeAPI, SimpleNamespace(chat=None)))
    return [(r.path, frozenset(r.methods or ())) for r in routes_of(app)]


# --- what a request is made of ---------------------------------------------------------

SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
PLAIN_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(FIELDS)
)
"""Values every parser takes: they reach the routes' own checks of each field."""
HOSTILE_SCALARS = (
    st.integers(min_value=2**63, max_value=2**80)
    | st.sampled_from([math.nan, math.inf, -math.inf])  # json.dumps writes them as tokens
    | st.text(st.characters() | SURROGATES, min_size=1, max_size=12).filter(
        lambda text: any(0xD800 <= ord(c) <= 0xDFFF for c in text)
    )
)
"""Values a strict parser refuses: integers past 64 bits, NaN and Infinity, lone surrogates."""


def values(scalars: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Arrays and objects of `scalars`, a few levels deep, keyed by the
    routes' fields or any text."""
    keys = st.sampled_from(FIELDS) | st.text(max_size=12)
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
        max_leaves=12,
    )


KINDS = (None, True, -1, 2**63, 0.5, "x", [1], {"a": 1})
"""A value of each JSON type, at an edge where it has one: the likeliest to
meet a check that assumed another type (an unhashable list, a float where
an int goes, one past the ledger's 64 bits)."""
PLAIN = values(PLAIN_SCALARS)
OBJECTS = st.dictionaries(st.sampled_from(FIELDS), PLAIN, max_size=6)
HOSTILE = st.dictionaries(st.sampled_from(FIELDS), values(PLAIN_SCALARS | HOSTILE_SCALARS))


def encoded(value: Any, ascii_only: bool = True) -> bytes:
    """`value` as a body: surrogates as `\\ud800` escapes, or written raw
    (then not UTF-8 at all)."""
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def nested(depth: int, leaf: bytes) -> bytes:
    return b"[" * depth + leaf + b"]" * depth


def evidence_json(reporter: bytes) -> dict[str, Any]:
    """Well-formed evidence from `reporter` against a made-up first hop that
    signed a commitment no shard computed (its recomputation is never run)."""
    hop = Identity.generate()
    commitment = Commitment(
        hop=hop.node_id, entry=reporter, session="ab" * 16, model="tiny", layers=(0, 4),
        sketch_seed=5, step=0, pos=0, count=2, inputs_digest=ids_digest(np.array([5, 6])),
        inputs=np.zeros((0, SKETCH_DIMS), np.float32),
        outputs=np.ones((1, SKETCH_DIMS), np.float32), token=7,
    ).signed(hop)  # fmt: skip
    evidence = Evidence(
        reporter=reporter, kind="output", hop_index=0, model="tiny", prompt=(5, 6),
        tokens=(7,), sampling=SamplingParams(temperature=0.0), seed=0, layers=((0, 4),),
        commitment=commitment,
    )  # fmt: skip
    return evidence.to_json()


def valid_bodies() -> dict[str, dict[str, Any]]:
    """A well-formed body for each POST route: what `mutated` changes in one
    or two places, so that every field's check is reached, not just the first."""
    node_id = node_id_text(Identity.generate().node_id)
    return {
        "/v1/chat/completions": {
            "model": "tiny",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "stream": False,
            "stream_options": {"include_usage": True},
            "max_tokens": 4,
            "temperature": 0.5,
            "seed": 1,
            "stop": ["x"],
        },
        "/v1/completions": {
            "model": "tiny",
            "prompt": ["once upon", [1, 2, 3]],
            "stream": False,
            "stream_options": {"include_usage": True},
            "max_tokens": 4,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 1,
            "stop": ["x"],
            "echo": True,
            "logprobs": 2,
            "suffix": None,
        },
        "/v1/network/policy": {"idle_release_s": 600, "cooldown_s": 30},
        "/v1/network/voters": {"node_id": node_id},
        "/v1/nodes/assign": dict(node_id=node_id, model="tiny", layers=[0, 4], recipe="fp32"),
        "/v1/network/assign": {"memory_bytes": 10**9, "models": ["tiny"]},
        "/v1/network/invitations": {"voter": False, "expires_s": 60, "uses": 2},
        "/v1/network/join": {
            "invitation": "smi1.AAAA",
            "node_id": node_id,
            "at": 1,
            "signature": "00" * 64,
        },
        "/v1/debug/faults": {"isolate": False},
        "/v1/network/refound": {},
        "/v1/network/demand": {"model": "tiny", "count": 1},
        EVIDENCE_PATH: evidence_json(MEMBER.node_id),
        PUNCH_PATH: {"plane": "data", "method": "reverse", "host": "10.0.0.1", "port": 45000},
    }


VALID = valid_bodies()
DELETE = object()
"""A mutation that removes the field."""


def places(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in `value` (a key or index path), `value` itself first."""
    found = [at]
    if isinstance(value, dict | list):
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            found += places(item, (*at, key))
    return found


def mutated(body: Any, changes: list[tuple[int, Any]]) -> Any:
    """`body` with each (place number, new value) of `changes` applied."""
    body = json.loads(json.dumps(body))
    for number, new in changes:
        every = places(body)
        place = every[number % len(every)]
        if not place:  # the whole body
            body = {} if new is DELETE else new
            continue
        container = body
        for key in place[:-1]:
            container = container[key]
        if new is DELETE:
            del container[place[-1]]
        else:
            container[place[-1]] = new
    return body


@cache  # one strategy a route: hypothesis checks each strategy it is handed
def bodies(route: str) -> st.SearchStrategy[bytes]:
    """Bodies for `route`: its valid body changed in one or two places
    (twice in eight), objects of the routes' fields, hostile values, deep
    nesting, long integers and arbitrary bytes."""
    valid = VALID.get(route, {})
    change = st.tuples(st.integers(0, 10**6), PLAIN | HOSTILE_SCALARS | st.just(DELETE))
    near = st.builds(mutated, st.just(valid), st.lists(change, min_size=1, max_size=2))
    return st.one_of(
        st.builds(encoded, near),
        st.builds(encoded, near),
        st.builds(encoded, OBJECTS | PLAIN),
        st.builds(encoded, HOSTILE, st.booleans()),
        st.builds(nested, st.integers(MAX_JSON_DEPTH - 2, 30_000), st.sampled_from([b"", b"1"])),
        st.integers(MAX_JSON_DEPTH - 2, 200).map(
            lambda depth: b'{"messages": ' + nested(depth, b'{"content": "x"}') + b"}"
        ),
        st.integers(20, 5_000).map(lambda digits: b'{"count": ' + b"9" * digits + b"}"),
        st.binary(max_size=300),
    )


CONTENT_TYPES = st.sampled_from(
    ["application/json", "application/json; charset=utf-8", "APPLICATION/JSON", "text/plain",
     "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""]
)  # fmt: skip
CREDENTIALS = st.sampled_from(["operator", "member", "stranger", "wrong token", "none"])
HOSTS = st.sampled_from(["localhost", "localhost", "127.0.0.1:8000", "[::1]", "evil.example"])
SEGMENTS = st.text(st.characters(exclude_characters="/?#") | SURROGATES, min_size=1, max_size=20)
QUERIES = st.text(st.sampled_from("model=x&%ED%A0%80ab=;"), max_size=30)


def headers_for(
    portal: Portal, path: str, body: bytes, credential: str, content_type: str, host: str
) -> dict[str, str]:
    """The headers of one request: its credential, content type and Host."""
    given: dict[str, str] = {"host": host}
    if content_type:
        given["content-type"] = content_type
    if credential == "operator":
        given["authorization"] = f"Bearer {TOKEN}"
    elif credential == "wrong token":
        given["authorization"] = "Bearer nope"
    elif credential in ("member", "stranger"):
        signed = portal.node.signed(path, body, MEMBER if credential == "member" else STRANGER)
        signed.pop("content-type")
        given.update(signed)
    return given


def assert_answer_is_sane(answer: httpx.Response, method: str, path: str) -> None:
    """No 5xx but a retryable 503; every error in OpenAI's shape."""
    status = answer.status_code
    where = f"{method} {path}: {status} {answer.text[:300]}"
    assert status < 500 or (status == 503 and "retry-after" in answer.headers), where
    if status >= 400:
        assert answer.headers["content-type"] == "application/json", where
        error = answer.json()["error"]
        assert {"message", "type", "param", "code"} <= set(error), where
        assert isinstance(error["message"], str) and error["message"], where


@pytest.mark.parametrize("path", [p for p, methods in route_paths() if "POST" in methods])
@BODY_FUZZ
@given(data=st.data())
def test_no_body_is_answered_500(portal: Portal, path: str, data: st.DataObject) -> None:
    """Any body POSTed to `path`, past its gate: JSON, with the credential
    the route takes, to the node's own name."""
    body = data.draw(bodies(path), label="body")
    credential = "member" if path in MEMBER_REPORTS else "operator"
    headers = headers_for(portal, path, body, credential, JSON_TYPE, "localhost")
    assert_answer_is_sane(portal.request("POST", path, body, headers), "POST", path)


@pytest.mark.parametrize("path", sorted(VALID))
def test_no_field_given_a_value_of_another_kind_is_answered_500(portal: Portal, path: str) -> None:
    """Every place of the route's valid body (the body itself included)
    given each of `KINDS`, or removed, one at a time: what random bodies
    reach only by luck."""
    valid = VALID[path]
    credential = "member" if path in MEMBER_REPORTS else "operator"
    for number in range(len(places(valid))):
        for new in (*KINDS, DELETE):
            body = encoded(mutated(valid, [(number, new)]))
            headers = headers_for(portal, path, body, credential, JSON_TYPE, "localhost")
            assert_answer_is_sane(portal.request("POST", path, body, headers), "POST", path)


@pytest.mark.parametrize("path", [p for p, _ in route_paths()])
@ENVELOPE_FUZZ
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
    body=st.sampled_from([b"{}", b'{"model": "tiny", "isolate": false}', b"[", b""]),
    content_type=CONTENT_TYPES,
    credential=CREDENTIALS,
    host=HOSTS,
    segments=st.lists(SEGMENTS, min_size=2, max_size=2),
    query=QUERIES,
)
def test_no_request_is_answered_500(
    portal: Portal,
    path: str,
    method: str,
    body: bytes,
    content_type: str,
    credential: str,
    host: str,
    segments: list[str],
    query: str,
) -> None:
    """Any method, content type, credential, Host, path parameters (any
    text, as UTF-8 percent escapes, lone surrogates included) and query."""
    digest, name = (quote(s.encode("utf-8", "surrogatepass"), safe="") for s in segments)
    url = path.replace("{digest}", digest).replace("{name}", name)
    headers = headers_for(portal, url, body, credential, content_type, host)
    answer = portal.request(method, f"{url}?{query}" if query else url, body, headers)
    assert_answer_is_sane(answer, method, path)


def test_every_route_is_fuzzed_but_those_named() -> None:
    """A new route is fuzzed by the properties without a change here; a new
    POST route needs its valid body in `valid_bodies`."""
    paths = dict(route_paths())
    routes = {"/v1/chat/completions", "/v1/completions", "/v1/network/join", "/v1/network/policy"}
    assert routes <= paths.keys()
    assert len(paths) >= 20 and not paths.keys() & NOT_FUZZED.keys()
    assert VALID.keys() == {path for path, methods in paths.items() if "POST" in methods}
