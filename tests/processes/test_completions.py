"""Text completions, models without a chat template, and GGUF files served directly
(issue 32, items 1, 5 and 6), as real `shardmesh` processes on loopback.

Three nodes serve a tiny model whose tokenizer has no chat template, a
span each (the third by `serve`): chat requests are a 400 naming `/v1/completions`, the serving
line and `/v1/models` say it has none, and the official `openai` client's
`completions.create` answers, plain, streamed, for a list of prompts, and
with `echo` and `logprobs` equal to torch's log-softmax of transformers'
logits on the same folder (fp32, within 1e-4); `suffix` and bad bodies are
400s. lm-evaluation-harness scores a loglikelihood task written to a local
file through the swarm (its `local-completions` model) and in process (its
`hf` model): the per-example scores agree within 1e-4.

A founder serves a GGUF file written with the `gguf` package
(`serve model.gguf`): imported once into its state dir with progress, its
chat template kept, so it chats, and the official client's chat
`logprobs`/`top_logprobs` equal transformers' on the imported folder, and
each of a hundred seeded sampled `json_schema` chats through that client
parses and validates against the schema.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from runtime.cli.localswarm import LocalNode, LocalSwarm, Views
from runtime.cli.model_source import IMPORTED_DIR
from runtime.model.manifest import has_chat_template
from runtime.model.tiny import CHAT_TEMPLATE, make_tiny_model
from tests.runtime.inference.test_constrained_engine import SCHEMA
from tests.runtime.model.test_gguf_import import write_gguf
from tests.swarm_helpers import START_TIMEOUT_S, assert_no_internal_errors, wait_for

MODEL = "base"
PROMPT = "The swarm of volunteers"
MAX_TOKENS = 6
TOP = 5
TOLERANCE = 1e-4
SPANS = ("0:2", "2:3")
"""The pinned nodes' layers of the four-layer base model; the third node
serves what they leave (3:4)."""
LM_EVAL_DOCS = (
    {"context": "The swarm of", "continuation": " volunteers"},
    {"context": "A hop serves", "continuation": " layers of a model"},
    {"context": "Peer to peer", "continuation": " inference"},
)
SERVE_TIMEOUT_S = 60.0
"""From start to the span admitted (a manifest build, the doctor), on a loaded 2-core box."""
LOG_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("models") / MODEL
    return make_tiny_model(folder, layers=4, chat_template=False)  # --model takes a manifest


def served(observer: LocalNode, model: str) -> Callable[[Views], bool]:
    def check(views: Views) -> bool:
        coverage = (views.get(observer.name) or {}).get("coverage", {}).get(model)
        return coverage is not None and not coverage["gaps"]

    return check


async def logged(node: LocalNode, text: str) -> str:
    with trio.move_on_after(LOG_TIMEOUT_S):
        while text not in (log := node.log_path.read_text()):
            await trio.sleep(0.1)
        return log
    raise AssertionError(f"{node.name} never logged {text!r}:\n{node.log_tail()}")


def reference(
    model_dir: Path, prompt: str | list[int], max_tokens: int
) -> tuple[list[int], list[int], Any]:
    """transformers on `model_dir`: the prompt's ids, the greedy
    continuation's, and torch's log-softmax of every position's logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
    new = out[0, len(ids) :].tolist()
    with torch.no_grad():
        logits = model(out).logits[0]
    return ids, new, torch.log_softmax(logits.float(), dim=-1)


def check_logprobs(logprobs: Any, ids: list[int], new: list[int], expected: Any) -> float:
    """A choice's echoed logprobs against the reference; the largest error."""
    tokens = [*ids, *new]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert len(logprobs.token_logprobs) == len(tokens)
    worst = 0.0
    for i in range(1, len(tokens)):
        worst = max(worst, abs(logprobs.token_logprobs[i] - float(expected[i - 1, tokens[i]])))
        best = expected[i - 1].topk(TOP).values.tolist()
        # By text, as OpenAI's are: byte tokens that decode alike share a key.
        got = logprobs.top_logprobs[i].values()
        assert 0 < len(got) <= TOP
        worst = max(worst, abs(max(got) - best[0]))
        worst = max(worst, *(min(abs(value - b) for b in best) for value in got))
    assert worst < TOLERANCE, worst
    return worst


def chat_reference(model_dir: Path, messages: list[dict[str, str]], max_tokens: int) -> Any:
    """`reference` of the chat's prompt, as the model's own template renders it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    return reference(model_dir, ids, max_tokens)


def chat_logprobs_with_openai(api: str, model_dir: Path) -> None:
    """Issue 32: chat logprobs in OpenAI's chat shape, equal to transformers'."""
    import openai

    messages = [{"role": "user", "content": "hi"}]
    client = openai.OpenAI(base_url=api + "/v1", api_key="unused")
    answer = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=TOP,
    )
    ids, new, expected = chat_reference(model_dir, messages, MAX_TOKENS)
    content = answer.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and 0 < len(content) <= len(new)
    worst = 0.0
    for i, entry in enumerate(content):
        row = expected[len(ids) + i - 1]
        worst = max(worst, abs(entry.logprob - float(row[new[i]])))
        best = row.topk(TOP).values.tolist()
        assert 0 < len(entry.top_logprobs) <= TOP
        assert bytes(entry.bytes or []).decode() == entry.token
        worst = max(worst, *(min(abs(t.logprob - b) for b in best) for t in entry.top_logprobs))
    assert worst < TOLERANCE, worst


SCHEMA_RUNS = 100
SCHEMA_MAX_TOKENS = 32
"""Past the schema's longest object."""


def json_schema_runs_with_openai(api: str) -> set[str]:
    """Issue 32: every seeded sampled run of a `json_schema` chat through the
    official client parses and validates; the texts they wrote."""
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=api + "/v1", api_key="unused")
    texts = set()
    for seed in range(SCHEMA_RUNS):
        answer = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Pick a colour."}],
            max_tokens=SCHEMA_MAX_TOKENS,
            temperature=1.0,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True},
            },
        )
        text = answer.choices[0].message.content
        assert text is not None, answer
        value = json.loads(text)
        jsonschema.validate(value, SCHEMA)
        texts.add(text)
    return texts


def complete_with_openai(api: str, ids: list[int], new: list[int], expected: Any) -> None:
    import openai

    client = openai.OpenAI(base_url=api + "/v1", api_key="unused")
    plain = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    text = plain.choices[0].text
    assert plain.object == "text_completion" and plain.choices[0].logprobs is None
    assert plain.usage is not None and plain.usage.prompt_tokens == len(ids)
    echoed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, echo=True, logprobs=TOP
    )
    choice = echoed.choices[0]
    assert choice.text == PROMPT + text
    assert choice.logprobs is not None
    check_logprobs(choice.logprobs, ids, new, expected)
    assert choice.logprobs.text_offset[0] == 0
    # A list of prompts (token ids among them): a choice each, in order.
    both = client.completions.create(
        model=MODEL, prompt=[PROMPT, ids], max_tokens=MAX_TOKENS, temperature=0
    )
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [text, text]
    # lm-evaluation-harness' loglikelihood request (its local-completions
    # model): token ids, one new token, echo, logprobs=1; it sums the
    # context's continuation from the echoed token_logprobs.
    scored = (
        client.completions.create(
            model=MODEL, prompt=[ids], max_tokens=1, logprobs=1, echo=True, temperature=0, seed=1
        )
        .choices[0]
        .logprobs
    )
    assert scored is not None
    loglikelihood = sum(scored.token_logprobs[2 : len(ids)])
    assert (
        abs(loglikelihood - sum(float(expected[i - 1, ids[i]]) for i in range(2, len(ids))))
        < TOLERANCE
    )
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == text


def lm_eval_task(folder: Path) -> Path:
    """A loglikelihood task of LM_EVAL_DOCS, from a local JSON file (no hub)."""
    folder.mkdir()
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in LM_EVAL_DOCS))
    (folder / "shardmesh_tiny.yaml").write_text(
        "task: shardmesh_tiny\n"
        "dataset_path: json\n"
        f"dataset_kwargs: {{data_files: {{test: {json.dumps(str(data))}}}}}\n"
        "test_split: test\n"
        "output_type: loglikelihood\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_target: "{{continuation}}"\n'
        "metric_list: [{metric: perplexity}]\n"
    )
    return folder


def lm_eval_scores(tasks: Path, model: str, model_args: dict[str, Any]) -> list[float]:
    """lm_eval's per-example loglikelihoods of the task in `tasks`, by `model`."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["shardmesh_tiny"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
        bootstrap_iters=0,
    )
    assert results is not None
    samples = sorted(results["samples"]["shardmesh_tiny"], key=lambda s: s["doc_id"])
    return [float(sample["filtered_resps"][0][0]) for sample in samples]


def score_with_lm_eval(api: str, model_dir: Path, tasks: Path) -> None:
    """Issue 32: lm_eval's `local-completions` through the swarm equals its `hf` model."""
    remote = lm_eval_scores(
        tasks,
        "local-completions",
        {
            "base_url": api + "/v1/completions",
            "model": MODEL,
            "tokenizer": str(model_dir),
            "tokenizer_backend": "huggingface",
            "num_concurrent": 1,
            "max_retries": 1,
        },
    )
    local = lm_eval_scores(
        tasks, "hf", {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"}
    )
    assert len(remote) == len(LM_EVAL_DOCS)
    assert max(abs(a - b) for a, b in zip(remote, local, strict=True)) < TOLERANCE, (remote, local)


async def test_a_model_without_a_chat_template_takes_completions_not_chat(
    swarm: LocalSwarm, base_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two spans pinned, and `serve`, which takes the layers the swarm lacks
    # and says in its serving line that the model has no chat template.
    nodes = [
        *(swarm.new_node(args=["--model", str(base_dir), "--layers", span]) for span in SPANS),
        swarm.new_node("server", command=["serve", str(base_dir)]),
    ]
    founder, server = nodes[0], nodes[-1]
    await swarm.start_ready(founder, timeout=START_TIMEOUT_S)
    await swarm.start_many(nodes[1:], [founder.seed], timeout=START_TIMEOUT_S)
    await wait_for(swarm, [founder], served(founder, MODEL), SERVE_TIMEOUT_S, "served")
    await logged(server, "no chat template: text completions only (/v1/completions)")
    api = founder.api
    async with httpx.AsyncClient(timeout=60) as client:
        chat = await client.post(
            api + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert chat.status_code == 400, chat.text
        error = chat.json()["error"]
        assert "/v1/completions" in error["message"] and error["code"] == "no_chat_template"
        models = (await client.get(api + "/v1/models")).json()["data"]
        assert [(m["id"], m["chat_template"]) for m in models] == [(MODEL, False)]
        for body, param in (
            ({"model": MODEL, "prompt": PROMPT, "suffix": "the end"}, "suffix"),
            ({"model": MODEL, "prompt": {"text": PROMPT}}, "prompt"),
            ({"model": MODEL, "prompt": PROMPT, "logprobs": 6}, "logprobs"),
            ({"model": MODEL, "prompt": [[10**9]]}, "prompt"),
        ):
            refused = await client.post(api + "/v1/completions", json=body)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == param
    ids, new, expected = await trio.to_thread.run_sync(reference, base_dir, PROMPT, MAX_TOKENS)
    await trio.to_thread.run_sync(complete_with_openai, api, ids, new, expected)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    tasks = lm_eval_task(tmp_path / "tasks")
    await trio.to_thread.run_sync(score_with_lm_eval, api, base_dir, tasks)
    await assert_no_internal_errors(swarm, nodes)


async def test_serve_imports_a_gguf_file_once_and_keeps_its_chat_template(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    llama = make_tiny_model(
        tmp_path / "llama", layers=2, family="llama", tie_embeddings=True, with_manifest=False
    )
    gguf_file = tmp_path / "tiny.gguf"
    write_gguf(llama, gguf_file, chat_template=CHAT_TEMPLATE)
    founder = swarm.new_node("founder", command=["serve", str(gguf_file)])
    await swarm.start_ready(founder, timeout=START_TIMEOUT_S)
    await wait_for(swarm, [founder], served(founder, "tiny"), SERVE_TIMEOUT_S, "served")
    log = await logged(founder, "serving tiny layers 0:2 (fp32); chat at")
    assert "importing tiny.gguf: reading tiny.gguf" in log and "converting the tokenizer" in log
    (imported,) = (founder.state_dir / IMPORTED_DIR).iterdir()
    assert has_chat_template(imported)
    async with httpx.AsyncClient(timeout=60) as client:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        answer = await client.post(founder.api + "/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
    await trio.to_thread.run_sync(chat_logprobs_with_openai, founder.api, imported)
    texts = await trio.to_thread.run_sync(json_schema_runs_with_openai, founder.api)
    assert len(texts) > 1, f"sampled runs, not one answer repeated: {texts}"
    # The same file again: served from the import, not imported anew.
    assert await swarm.stop(founder) == 0
    await swarm.start_ready(founder, timeout=START_TIMEOUT_S)
    await wait_for(swarm, [founder], served(founder, "tiny"), SERVE_TIMEOUT_S, "served again")
    assert founder.log_path.read_text().count("converting the tokenizer") == 1
    assert [p.name for p in (founder.state_dir / IMPORTED_DIR).iterdir()] == [imported.name]
    await assert_no_internal_errors(swarm, [founder])
