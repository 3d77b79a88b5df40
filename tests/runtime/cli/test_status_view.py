"""`shardmesh status`'s fetch and table (`runtime.cli.status_view`).

The fetch runs against a real HTTP server on loopback (the standard
library's, in a thread) answering each way a node might: a status document,
an error, something that is not JSON, JSON that is no status, or nothing at
all. The report is checked line by line for a document with every section
a node fills in, and for the defaults of an empty one.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from runtime.cli.status_view import (
    RECENT_DECISIONS_SHOWN,
    STATUS_PATH,
    StatusError,
    fetch_status,
    format_drops,
    format_members,
    format_status,
    render,
    short,
    summary_line,
)

SELF = "a" * 64
PEER = "b" * 64
STATUS: dict[str, Any] = {
    "node_id": SELF,
    "incarnation": 3,
    "profile": "local",
    "members": [
        {"node_id": SELF, "state": "alive", "incarnation": 3, "addr": "tcp://h:1", "self": True},
        {"node_id": PEER, "state": "suspect", "incarnation": 12, "addr": "tcp://h:2",
         "last_seen": 4.25},
        {"node_id": "c" * 64, "state": "alive", "incarnation": 1, "addr": "tcp://h:3",
         "last_seen": 95.0},
        {"node_id": "d" * 64, "state": "dead", "addr": "tcp://h:4", "last_seen": 600.0},
    ],
    "leader": SELF,
    "term": 4,
    "commit_index": 17,
    "coverage": {"tiny": {"layers": 8, "covered": [[0, 4]], "gaps": [[4, 8]]}},
    "raft": {"role": "leader", "voters": [SELF], "learners": [PEER]},
    "ledger": [
        {"node_id": PEER, "model": "tiny", "layers": [0, 4], "recipe": "fp32", "tier": 1,
         "managed": True, "epoch": 2},
    ],
    "placement": {
        "waiting": {"tiny": "no_capacity", "other": "serving"},
        "decisions": [
            {"command": "assign", "model": "tiny", "layers": [0, 4], "node_id": PEER,
             "code": "ok", "reason": f"decision {i}"}
            for i in range(RECENT_DECISIONS_SHOWN + 2)
        ],
    },
    "demand": {"tiny": {"count": 5}},
    "policy_settings": {"max_copies": 2},
    "sessions": 1,
    "drops": {"stale": 2, "bad_signature": 1},
}  # fmt: skip


class Answers:
    """What the server answers next: a status code and a body."""

    status = 200
    body = b"{}"
    paths: list[str] = []


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        Answers.paths.append(self.path)
        self.send_response(Answers.status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(Answers.body)))
        self.end_headers()
        self.wfile.write(Answers.body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def node_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    Answers.paths = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def answer(status: int, body: bytes) -> None:
    Answers.status, Answers.body = status, body


def test_the_status_document_is_fetched_from_its_path(node_url: str) -> None:
    answer(200, json.dumps(STATUS).encode())
    assert fetch_status(node_url + "/") == STATUS
    assert Answers.paths == [STATUS_PATH]


@pytest.mark.parametrize(
    ("status", "body", "words"),
    [
        (500, b'{"error": "boom"}', 'answered 500: {"error": "boom"}'),
        (200, b"<html>", "did not answer JSON"),
        (200, b'{"node_id": "x"}', "did not answer a network status document"),
        (200, b"[1, 2]", "did not answer a network status document"),
    ],
)
def test_an_answer_that_is_no_status_is_an_error_naming_the_url(
    node_url: str, status: int, body: bytes, words: str
) -> None:
    answer(status, body)
    with pytest.raises(StatusError) as raised:
        fetch_status(node_url)
    assert str(raised.value).startswith(node_url + STATUS_PATH)
    assert words in str(raised.value)


def test_a_node_that_is_not_there_is_an_error() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    server.server_close()  # nothing listens there now
    with pytest.raises(StatusError, match=f"cannot reach {url}{STATUS_PATH}"):
        fetch_status(url, timeout=2.0)


def test_the_member_table_marks_self_and_says_how_long_ago_each_was_heard() -> None:
    assert format_members(STATUS) == [
        "NODE           STATE    INC  ADDR       LAST SEEN",
        "aaaaaaaaaaaa*  alive      3  tcp://h:1  self",
        "bbbbbbbbbbbb   suspect   12  tcp://h:2  4.2s ago",
        "cccccccccccc   alive      1  tcp://h:3  95s ago",
        "dddddddddddd   dead       ?  tcp://h:4  10m ago",
    ]
    assert short(None) == "-" and short("") == "-" and short(PEER) == "b" * 12


def test_the_report_has_a_line_for_each_section() -> None:
    report = format_status(STATUS).splitlines()
    assert (
        report[0]
        == summary_line(STATUS)
        == (
            "node aaaaaaaaaaaa (incarnation 3, profile local): 4 members: "
            "2 alive, 1 dead, 1 suspect"
        )
    )
    assert report[1] == "" and report[2].startswith("NODE") and report[7] == ""
    rest = report[8:]
    assert rest[:5] == [
        "leader: aaaaaaaaaaaa (term 4, commit index 17)",
        "coverage: tiny (8 layers): covered [0, 4); gaps [4, 8)",
        "raft: leader; voters aaaaaaaaaaaa; learners bbbbbbbbbbbb",
        "assignment: bbbbbbbbbbbb tiny [0, 4) fp32 tier 1 managed=True (epoch 2)",
        "waiting: tiny (no_capacity)",  # a model being served is not waiting
    ]
    placed = [line for line in rest if line.startswith("placed: ")]
    assert len(placed) == RECENT_DECISIONS_SHOWN  # the most recent ones
    assert placed[-1] == (
        f"placed: assign tiny [0, 4) on bbbbbbbbbbbb: ok (decision {RECENT_DECISIONS_SHOWN + 1})"
    )
    assert rest[-4:] == [
        "demand: tiny=5",
        "policy: max_copies=2 (the rest default; see `shardmesh policy`)",
        "sessions: 1",
        "drops: bad_signature=1, stale=2",
    ]


def test_a_hop_that_batched_says_how_full_its_batches_ran() -> None:
    batched = {**STATUS, "hop": {"batching": {"batches": 12, "mean_rows": 3.5, "largest": 8}}}
    sessions = next(line for line in format_status(batched).splitlines() if "sessions" in line)
    assert sessions == "sessions: 1; decode batches: 12, 3.5 rows on average, at most 8"
    none_yet = {**STATUS, "hop": {"batching": {"batches": 0, "mean_rows": 0, "largest": 0}}}
    assert "sessions: 1" in format_status(none_yet).splitlines()


def test_an_empty_document_reports_the_defaults() -> None:
    assert format_status({}).splitlines() == [
        "node - (incarnation None, profile ?): 0 members: none",
        "",
        "NODE  STATE  INC  ADDR  LAST SEEN",
        "",
        "leader: none (term 0, commit index 0)",
        "sessions: 0",
        "drops: none",
    ]
    assert format_drops({}) == "drops: none"


def test_a_lost_leader_is_said_under_the_leader_line_with_what_to_do() -> None:
    lost = {
        **STATUS,
        "leader": None,
        "leadership": {
            "state": "leaderless",
            "lost": "d" * 64,
            "why": "the leader dddddddddddd was declared dead 42 s ago",
            "fix": "restart dddddddddddd with its own --state-dir",
        },
    }
    report = format_status(lost).splitlines()
    at = report.index("leader: none (term 4, commit index 17)")
    assert report[at + 1 : at + 3] == [
        "  why: the leader dddddddddddd was declared dead 42 s ago",
        "  fix: restart dddddddddddd with its own --state-dir",
    ]
    following = {**STATUS, "leadership": {"state": "following", "why": None, "fix": None}}
    assert format_status(following) == format_status(STATUS)


def test_json_is_the_raw_document_for_scripts() -> None:
    assert json.loads(render(STATUS, as_json=True)) == STATUS
    assert render(STATUS, as_json=False) == format_status(STATUS)


@pytest.mark.parametrize(
    "says",
    [
        "reachable at tcp://10.77.1.2:7001",
        "behind NAT: serving through relay tcp://10.77.1.2:7101 (peers cannot dial "
        "tcp://192.168.3.2:7001)",
        "checking reachability…",
    ],
)
def test_reachability_is_said_in_words_under_the_summary(says: str) -> None:
    report = format_status({**STATUS, "reachability": {"verdict": "x", "says": says}})
    assert report.splitlines()[:3] == [summary_line(STATUS), f"reachability: {says}", ""]
