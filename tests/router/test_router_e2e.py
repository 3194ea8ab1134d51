"""kv-router in front of two real engines, end to end: Redis, offloadd and kv-bridge as
subprocesses, two ``kv-engine serve --http-port`` processes on a tiny random model publishing
their KV events through the daemon, the router following the bridge; the official ``openai``
client talks to the router only."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from kvcache.v1 import generate_pb2, generate_pb2_grpc

from tests.router.procs import Proc, get_json, routed_stack, router
from tests.support.bridge_proc import BridgeProcess

DOC = "Document 7. The router sends each request to the engine that holds its prefix. " * 3


@dataclass
class Fleet:
    engines: list[Proc]
    router: Proc
    workdir: Path
    bridge: BridgeProcess
    holder: dict[str, str] = field(default_factory=dict)

    def client(self, proc: Proc | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{(proc or self.router).url}/v1", api_key="none", max_retries=0)

    def status(self, proc: Proc | None = None) -> dict[str, Any]:
        return get_json(f"{(proc or self.router).url}/status")[1]

    def wait_gpu_blocks(self, name: str, at_least: int, proc: Proc | None = None) -> None:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            blocks = {e["name"]: e["gpu_blocks"] for e in self.status(proc)["engines"]}
            if blocks[name] >= at_least:
                return
            time.sleep(0.05)
        raise AssertionError(f"the router never saw {at_least} GPU blocks of {name}: {self.status(proc)}")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("router-e2e")
    with routed_stack(work, 2) as stack:
        yield Fleet(stack.engines, stack.router, work, stack.bridge)


def _complete(client: openai.OpenAI, prompt: str, **kw: Any) -> Any:
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True}, **kw)


def test_a_shared_prefix_goes_where_it_is_cached(fleet: Fleet) -> None:
    client = fleet.client()
    first = _complete(client, DOC + "Question: what is it?")
    d1 = fleet.status()["decisions"][-1]
    assert d1["reason"] == "no_prefix" and d1["predicted_cached_tokens"] == 0 and d1["cached_tokens"] == 0
    holder = fleet.holder["doc"] = d1["engine"]
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    fleet.wait_gpu_blocks(holder, (len(DOC) + 21) // 16)
    for question in ("Question: who wrote it?", "Question: why?"):
        again = _complete(client, DOC + question)
        d = fleet.status()["decisions"][-1]
        assert (d["engine"], d["reason"]) == (holder, "gpu_prefix"), d
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached >= len(DOC) // 16 * 16 - 16 and d["predicted_cached_tokens"] == d["cached_tokens"] == cached
    other = _complete(client, "Something else entirely, with no shared prefix at all, none.")
    d = fleet.status()["decisions"][-1]
    assert d["reason"] == "no_prefix" and other.usage.prompt_tokens_details.cached_tokens == 0
    status = fleet.status()
    assert status["policy"] == "kv" and status["event_rate"] >= 0
    by_name = {e["name"]: e for e in status["engines"]}
    assert by_name[holder]["gpu_hit_tokens"] >= 2 * (len(DOC) // 16 * 16 - 16)
    assert all(e["healthy"] for e in status["engines"])
    code, page_data = get_json(f"{fleet.router.url}/api/fleet")  # the fleet page's feed (router.page)
    assert code == 200 and {e["name"] for e in page_data["engines"]} == {"e0", "e1"}


def test_chat_and_streaming_through_the_router(fleet: Fleet) -> None:
    client = fleet.client()
    messages: list[Any] = [{"role": "user", "content": DOC}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert all(c.usage is None for c in chunks)  # not asked for: the router keeps it to itself
    d = fleet.status()["decisions"][-1]
    assert d["cached_tokens"] is not None and d["cached_tokens"] == d["predicted_cached_tokens"]
    with_usage = list(client.completions.create(model="tiny", prompt=DOC, max_tokens=3, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
    assert with_usage[-1].usage is not None and with_usage[-1].usage.completion_tokens == 3


def test_errors_come_back_in_openai_shape(fleet: Fleet) -> None:
    client = fleet.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="too long"):  # the engine's 400, not retried
        _complete(client, "z" * 3000)
    with pytest.raises(openai.BadRequestError, match="one prompt"):
        client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=1)
    # {oops: not JSON; a lone surrogate escape: JSON, not UTF-8 (was a bare 500, not this shape)
    for body in (b"{oops", b'{"model": "tiny", "messages": [{"role": "user", "content": "a \\udc80"}]}'):
        req = urllib.request.Request(f"{fleet.router.url}/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=5)
        assert err.value.code == 400, body
        assert set(__import__("json").loads(err.value.read())["error"]) == {"message", "type", "param", "code"}
    assert [m.id for m in client.models.list()] == ["tiny"]
    metrics = urllib.request.urlopen(f"{fleet.router.url}/metrics", timeout=5).read().decode()
    assert 'kv_router_decisions_total{engine="' in metrics and 'reason="gpu_prefix"' in metrics
    assert "kv_router_prediction_agreement" in metrics and "kv_router_engine_in_flight" in metrics
    count = next(line for line in metrics.splitlines() if line.startswith("kv_router_decision_seconds_count"))
    assert float(count.split()[-1]) >= 5  # every routed request so far was timed


def test_grpc_generate_through_the_router(fleet: Fleet) -> None:
    holder = fleet.holder.get("doc") or pytest.skip("needs the first test's prefix")
    with grpc.insecure_channel(f"127.0.0.1:{fleet.router.grpc_port}") as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        req = generate_pb2.GenerateRequest(text=DOC + "Question: over gRPC?", sampling=generate_pb2.SamplingParams(
            max_tokens=3, ignore_eos=True))
        out = list(stub.Generate(req, timeout=60))
        assert out[-1].finished and sum(len(m.token_ids) for m in out) == 3
        d = fleet.status()["decisions"][-1]
        assert (d["engine"], d["reason"]) == (holder, "gpu_prefix")
        assert out[-1].num_gpu_cached_tokens == d["predicted_cached_tokens"] == d["cached_tokens"] > 0
        raw = channel.unary_stream("/kvcache.v1.Generate/Generate")
        with pytest.raises(grpc.RpcError) as err:
            list(raw(b"\xff\xff garbage", timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:  # the engine's refusal, passed on
            list(stub.Generate(generate_pb2.GenerateRequest(text="z" * 3000), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "too long" in (err.value.details() or "")


def test_a_dead_engine_is_taken_out_and_its_request_retried(fleet: Fleet) -> None:
    holder = fleet.holder.get("doc") or pytest.skip("needs the first test's prefix")
    # A router of its own whose health checks would not notice in time: the request must.
    slow = router(fleet.workdir / "slow", fleet.engines, f"--bridge-pub={fleet.bridge.pub}",
                  f"--bridge-replay={fleet.bridge.replay}", "--health-interval-s=60").start()
    try:
        fleet.wait_gpu_blocks(holder, 1, slow)
        dead = next(e for e in fleet.engines if e.name == holder)
        alive = next(e for e in fleet.engines if e.name != holder)
        dead.stop(kill=True)
        out = _complete(fleet.client(slow), DOC + "Question: still there?")
        assert out.choices[0].finish_reason == "length"
        decisions = fleet.status(slow)["decisions"]
        assert decisions[-2]["engine"] == holder and decisions[-2]["reason"].endswith("(failed, retried)")
        assert decisions[-1]["engine"] == alive.name and decisions[-1]["cached_tokens"] is not None
        assert {e["name"]: e["healthy"] for e in fleet.status(slow)["engines"]}[holder] is False
        # Back on the same port (under a new engine id: the crashed one's registration at the
        # daemon is live until its lease ends); the health checks put it back in rotation.
        dead.args = [a.replace(f"--engine-id={holder}", f"--engine-id={holder}-again") for a in dead.args]
        dead.start()
        deadline = time.monotonic() + 10
        while not {e["name"]: e["healthy"] for e in fleet.status()["engines"]}[holder]:
            assert time.monotonic() < deadline, fleet.status()
            time.sleep(0.1)
        dead.stop()
        alive.stop()
        with pytest.raises(openai.APIStatusError) as err:
            _complete(fleet.client(slow), "nobody home")
        assert err.value.status_code == 503 and "no engine" in str(err.value.message)
    finally:
        assert slow.stop() == 0  # SIGTERM: a clean exit
