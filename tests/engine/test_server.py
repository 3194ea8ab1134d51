"""The gRPC Generate service on a real server and port, and the kv-engine CLI."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvcache.v1 import generate_pb2, generate_pb2_grpc

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.engine_loop import EngineLoop
from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.server import create_server


@pytest.fixture(scope="module")
def served(plain_model: Path) -> Iterator[tuple[grpc.Channel, EngineLoop]]:
    loop = EngineLoop(EngineCore(EngineConfig(model_dir=str(plain_model), max_model_len=256))).start()
    server, port = create_server(loop, "127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        yield ch, loop
    server.stop(grace=1).wait()
    loop.stop()


@pytest.fixture
def channel(served: tuple[grpc.Channel, EngineLoop]) -> grpc.Channel:
    return served[0]


def _request(**kw: object) -> generate_pb2.GenerateRequest:
    sampling = generate_pb2.SamplingParams(max_tokens=6, ignore_eos=True)
    return generate_pb2.GenerateRequest(sampling=sampling, **kw)  # type: ignore[arg-type]


def test_stream_matches_offline_greedy(channel: grpc.Channel, plain_model: Path) -> None:
    stub = generate_pb2_grpc.GenerateStub(channel)
    prompt = list(range(10, 50))
    responses = list(stub.Generate(_request(request_id="r1", token_ids=generate_pb2.TokenIds(ids=prompt))))
    assert len(responses) == 6
    assert [r.finished for r in responses] == [False] * 5 + [True]
    assert responses[-1].finish_reason == "length"
    assert {r.request_id for r in responses} == {"r1"}
    assert responses[0].num_prompt_tokens == 40
    tokens = [t for r in responses for t in r.token_ids]
    ref = LLM(str(plain_model)).generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert tokens == ref[0].outputs[0].token_ids


def test_concurrent_streams_and_prefix_hits(channel: grpc.Channel) -> None:
    stub = generate_pb2_grpc.GenerateStub(channel)
    prompt = generate_pb2.TokenIds(ids=list(range(100, 180)))
    results: list[list[generate_pb2.GenerateResponse]] = []

    def run() -> None:
        results.append(list(stub.Generate(_request(token_ids=prompt))))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    streams = [[t for r in res for t in r.token_ids] for res in results]
    assert all(s == streams[0] for s in streams) and len(streams[0]) == 6
    again = list(stub.Generate(_request(token_ids=prompt)))
    assert again[-1].num_gpu_cached_tokens == 64


def test_text_prompt(channel: grpc.Channel) -> None:
    stub = generate_pb2_grpc.GenerateStub(channel)
    responses = list(stub.Generate(_request(text="hello there")))
    assert responses[0].num_prompt_tokens == 11 and responses[-1].finished


@pytest.mark.parametrize(
    ("kw", "sampling", "message"),
    [
        ({}, {}, "prompt is empty"),
        ({"text": ""}, {}, "prompt is empty"),
        ({"token_ids": generate_pb2.TokenIds(ids=[1] * 300)}, {}, "prompt is too long: 300 tokens"),
        ({"text": "x"}, {"temperature": -1.0}, "temperature must be a finite number >= 0"),
        ({"text": "x"}, {"top_p": 2.0}, r"top_p must be in \(0, 1\]"),
    ],
)
def test_bad_requests_get_invalid_argument(
    channel: grpc.Channel, kw: dict[str, object], sampling: dict[str, object], message: str
) -> None:
    stub = generate_pb2_grpc.GenerateStub(channel)
    req = generate_pb2.GenerateRequest(sampling=generate_pb2.SamplingParams(**sampling), **kw)  # type: ignore[arg-type]
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(req))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, info.value.details() or "")


def test_health_is_serving(channel: grpc.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("", "kvcache.v1.Generate"):
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_cancelled_stream_frees_its_blocks(served: tuple[grpc.Channel, EngineLoop]) -> None:
    channel, loop = served
    stub = generate_pb2_grpc.GenerateStub(channel)
    req = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=list(range(200, 240))),
        sampling=generate_pb2.SamplingParams(max_tokens=200, ignore_eos=True),
    )
    call = stub.Generate(req)
    next(call)
    call.cancel()
    deadline = time.monotonic() + 10
    while loop.core.has_unfinished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not loop.core.has_unfinished
    assert loop.core.kv.num_free_blocks == [256]
    # The engine keeps serving after the cancel.
    assert list(stub.Generate(_request(text="ok")))[-1].finished


def test_cli_serve_starts_and_stops_on_sigterm(plain_model: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", "--model", str(plain_model), "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("kv-engine: serving on port ")
        port = int(line.rsplit(" ", 1)[1])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            out = list(generate_pb2_grpc.GenerateStub(ch).Generate(_request(text="hi")))
            assert out[-1].finished
        proc.terminate()
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_cli_errors_have_no_traceback(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "engine", "generate", "--model", str(tmp_path), "--prompt", "x"],
        capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 2
    assert res.stderr.strip().endswith(f"kv-engine: error: {tmp_path}/config.json: not found (a model directory needs config.json)")
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--port", "70000", "--port must be in 0..65535, got 70000"),
    ("--metrics-port", "99999", "--metrics-port must be in -1..65535, got 99999"),
    ("--http-port", "-2", "--http-port must be in -1..65535, got -2"),
    ("--shutdown-grace-s", "inf", "--shutdown-grace-s must be >= 0 and finite, got inf"),
])
def test_cli_bad_numbers_are_refused_before_the_model_loads(flag: str, value: str, message: str) -> None:
    """A metrics port past 65535 was an OverflowError traceback once the model had loaded and
    Generate was serving; the checks come first now (the model directory here does not exist,
    so reaching the model would be a different error)."""
    res = subprocess.run([sys.executable, "-m", "engine", "serve", "--model", "/no/such/model", flag, value],
                         capture_output=True, text=True, timeout=60)
    assert (res.returncode, res.stderr.strip().splitlines()[-1]) == (2, f"kv-engine: error: {message}")
    assert "Traceback" not in res.stderr


def test_cli_make_tiny_model_and_generate(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "engine"]
    subprocess.run([*run, "make-tiny-model", str(tmp_path / "m"), "--hybrid", "--layers", "2"], check=True, timeout=60)
    res = subprocess.run(
        [*run, "generate", "--model", str(tmp_path / "m"), "--token-ids", "1,2,3", "--max-tokens", "3", "--ignore-eos"],
        capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert "finish_reason=length" in res.stderr
