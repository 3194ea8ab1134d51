"""The engine's OpenAI-compatible HTTP API, with the official ``openai`` client (unmodified)
against a real uvicorn server on a loopback port in front of a real engine on a tiny model."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.engine_loop import EngineLoop
from engine.http_api import create_app
from events.prompt import ChatMessage, load_chat_template
from rpc.http_server import ThreadedHttpServer

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(plain_model: Path) -> Iterator[tuple[ThreadedHttpServer, EngineLoop]]:
    cfg = EngineConfig(model_dir=str(plain_model), num_gpu_blocks=64, engine_id="http-test")
    loop = EngineLoop(EngineCore(cfg)).start()
    http = ThreadedHttpServer(create_app(loop, MODEL, load_chat_template(plain_model))).start()
    yield http, loop
    http.stop()
    loop.stop()


@pytest.fixture
def client(server: tuple[ThreadedHttpServer, EngineLoop]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"http://127.0.0.1:{server[0].port}/v1", api_key="none", max_retries=0) as c:
        yield c


def _raw(port: int, path: str, body: bytes | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_models_and_health(client: openai.OpenAI, server: tuple[ThreadedHttpServer, EngineLoop]) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    status, body = _raw(server[0].port, "/health")
    assert status == 200 and body["status"] == "ok" and body["engine_id"] == "http-test"
    assert body["requests_running"] == 0 and body["requests_waiting"] == 0


def test_completion_usage_counts_the_cached_prefix(client: openai.OpenAI) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 3  # 135 bytes: 8 full blocks
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert first.object == "text_completion" and first.choices[0].finish_reason == "length"
    assert first.usage is not None and first.usage.prompt_tokens == len(prompt.encode())
    assert first.usage.completion_tokens == 5 and first.usage.total_tokens == len(prompt) + 5
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    # (135 - 1) // 16 = 8 full blocks are reusable: one token is always left to compute.
    assert again.usage.prompt_tokens_details.cached_tokens == 128
    assert again.choices[0].text == first.choices[0].text  # greedy: the same tokens


def test_completion_from_token_ids(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=list(range(40)), max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage is not None and out.usage.prompt_tokens == 40 and out.usage.completion_tokens == 3


def test_streaming_completion_equals_the_whole_one(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt="stream me some text", max_tokens=8, temperature=0,
                              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 8 and chunks[-1].choices == []


def test_a_client_that_goes_away_frees_the_engine(client: openai.OpenAI,
                                                  server: tuple[ThreadedHttpServer, EngineLoop]) -> None:
    stream = client.completions.create(model=MODEL, prompt="a long answer, please", max_tokens=500,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 10
    while _raw(server[0].port, "/health")[1]["requests_running"]:
        assert time.monotonic() < deadline, "the engine kept generating for a client that left"
        time.sleep(0.05)


def test_chat_uses_the_plain_template(client: openai.OpenAI, plain_model: Path) -> None:
    messages: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True})
    rendered = load_chat_template(plain_model).render([ChatMessage("system", "Be brief."), ChatMessage("user", "Hello")])
    assert rendered == "System: Be brief.\nUser: Hello\nAssistant:"
    assert out.usage is not None and out.usage.prompt_tokens == len(rendered.encode())
    assert out.choices[0].message.role == "assistant" and out.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content


def test_chat_template_from_the_tokenizer_config(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"},
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}"}))
    template = load_chat_template(tmp_path)
    assert template.source == "tokenizer"
    assert template.render([ChatMessage("user", "hi")]) == "<s>[user]hi[assistant]"


def test_errors_in_openai_shape(client: openai.OpenAI, server: tuple[ThreadedHttpServer, EngineLoop]) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="other", prompt="x", max_tokens=1)
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="too long"):
        client.completions.create(model=MODEL, prompt="y" * 5000, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="out of range"):
        client.completions.create(model=MODEL, prompt=[1, 2, 99999], max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="one prompt"):
        client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=1)
    port = server[0].port
    for path, body in (("/v1/completions", b"{not json"), ("/v1/completions", b"[1]"),
                       ("/v1/chat/completions", b'{"messages": "hi"}'), ("/v1/nothing", b"{}"),
                       ("/v1/completions", b'{"prompt": "x", "temperature": 1e999}'),
                       ("/v1/completions", b'{"prompt": "x", "stop": [""]}'),
                       ("/v1/completions", b'{"prompt": "x", "stop_token_ids": [-1]}'),
                       ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}'),
                       # a lone surrogate escape: valid JSON, not UTF-8 (was a bare 500)
                       ("/v1/completions", b'{"prompt": "x \\udc80"}'),
                       ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\uD800"}]}')):
        status, answer = _raw(port, path, body)
        assert status in (400, 404), (path, body)
        assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["message"]
    # The engine is still fine.
    ok = client.completions.create(model=MODEL, prompt="still alive", max_tokens=2)
    assert ok.usage is not None and ok.usage.completion_tokens >= 1
