"""The text completion's request (`runtime.inference.completion`), without a route.

What the parser makes of OpenAI's legacy body: one `PromptCompletion` per
prompt, in order, whatever form each prompt takes (text or token ids);
OpenAI's defaults (16 tokens, no echo, no logprobs); and token ids checked
against the model's vocabulary only once the model is known. The route
around it: tests/runtime/api/test_completions.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.inference.chat import ChatError, ModelTokenizer
from runtime.inference.completion import MAX_PROMPTS, parse_completion_request
from runtime.model.tiny import make_tiny_model


def test_each_prompt_in_any_form_is_a_completion_in_order() -> None:
    request = parse_completion_request(
        {"model": "m", "prompt": ["one", [5, 6], "two"], "echo": True, "logprobs": 2}
    )
    assert [p.prompt for p in request.prompts] == ["one", (5, 6), "two"]
    assert all(p.echo and p.logprobs == 2 and p.model == "m" for p in request.prompts)
    single = parse_completion_request({"model": "m", "prompt": [7, 8, 9]})
    assert [p.prompt for p in single.prompts] == [(7, 8, 9)], "a flat list is one prompt's ids"


def test_openais_legacy_defaults() -> None:
    request = parse_completion_request({"model": "m", "prompt": "hi"})
    (prompt,) = request.prompts
    assert prompt.params.max_tokens == 16
    assert not prompt.echo and prompt.logprobs is None
    assert not request.stream and not request.include_usage


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ["a"] * (MAX_PROMPTS + 1)}, "prompt"),
        ({"prompt": "hi", "suffix": "bye"}, "suffix"),
        ({"prompt": "hi", "stream_options": []}, "stream_options"),
        ({"prompt": [[1], []]}, "prompt[1]"),
    ],
)
def test_a_bad_body_names_its_field(body: dict[str, object], param: str) -> None:
    with pytest.raises(ChatError) as caught:
        parse_completion_request({"model": "m", **body})
    assert caught.value.status == 400 and caught.value.param == param


def test_token_ids_are_checked_against_the_vocabulary_once_the_model_is_known(
    tmp_path: Path,
) -> None:
    tokenizer = ModelTokenizer(make_tiny_model(tmp_path / "m", layers=1, with_manifest=False))
    inside = parse_completion_request({"model": "m", "prompt": [1, 2]}).prompts[0]
    assert inside.encode(tokenizer) == [1, 2]
    outside = parse_completion_request({"model": "m", "prompt": [tokenizer.vocab_size]})
    with pytest.raises(ChatError) as caught:
        outside.prompts[0].encode(tokenizer)
    assert caught.value.param == "prompt" and str(tokenizer.vocab_size) in str(caught.value)
    text = parse_completion_request({"model": "m", "prompt": "hi"}).prompts[0]
    assert text.encode(tokenizer) == tokenizer.encode_text("hi")
