"""Bad input at the command line ends in one clear line and a non-zero exit, never a traceback:
a gRPC port already taken (grpcio raises a bare RuntimeError), TLS files that are not PEM
(grpcio fails later, at bind, naming neither file), model sizes of zero (ZeroDivisionError).
Real processes on loopback ports; each case checks the exact reason."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.__main__ import main as engine_main
from engine.model.checkpoint import TinyModelSpec, write_tiny_model
from rpc.targets import TargetError, check_grpc_target

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port something listens on, on every interface (IPv6 with IPv4 mapped, as [::] binds)."""
    with socket.socket(socket.AF_INET6) as sock:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model"), TinyModelSpec(num_layers=1))


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=120, cwd=REPO)


def test_offloadd_on_a_taken_grpc_port(tmp_path: Path, redis_url: str, taken_port: int) -> None:
    out = _run("offloadd", "--redis-url", redis_url, "--grpc-port", str(taken_port), "--metrics-port", "-1",
               "--namespace", "taken-port", "--arena-dir", str(tmp_path))
    assert out.returncode == 1, out.stderr
    assert f"cannot start: cannot listen on [::]:{taken_port}: the port is in use" in out.stderr
    assert "Traceback" not in out.stderr


def test_engine_on_a_taken_grpc_port(model: Path, taken_port: int) -> None:
    out = _run("engine", "serve", "--model", str(model), "--port", str(taken_port), "--metrics-port", "-1")
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines()[-1] == (
        f"kv-engine: error: cannot listen on [::]:{taken_port}: the port is in use or the address "
        "is not one of this host's")
    assert "Traceback" not in out.stderr


def test_tls_files_that_are_not_pem(tmp_path: Path, model: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    want = f"TLS certificate {str(junk)!r} is not PEM (no '-----BEGIN ...' block)"
    engine = _run("engine", "serve", "--model", str(model), "--port", "0", "--metrics-port", "-1",
                  "--tls-cert", str(junk), "--tls-key", str(junk))
    assert (engine.returncode, engine.stderr.strip().splitlines()[-1]) == (2, f"kv-engine: error: {want}")
    daemon = _run("offloadd", "--redis-url", "redis://127.0.0.1:1/0", "--metrics-port", "-1",
                  "--tls-cert-file", str(junk), "--tls-key-file", str(junk), "--arena-dir", str(tmp_path))
    assert daemon.returncode == 2 and f"cannot start: {want}" in daemon.stderr, daemon.stderr
    assert "Traceback" not in engine.stderr + daemon.stderr


@pytest.mark.parametrize("module, prog", [(["offloadd"], "offloadd: log_level: "),
                                          (["bridge.main"], "kv-bridge: error: argument --log-level: "),
                                          (["ingest", "--vllm", "a=tcp://127.0.0.1:5557"],
                                           "kv-ingest: error: argument --log-level: "),
                                          (["router.main"], "kv-router: error: argument --log-level: ")])
def test_a_bad_log_level_is_one_line_not_a_traceback(module: list[str], prog: str) -> None:
    """logging.basicConfig / setLevel raised ValueError("Unknown level: 'BOGUS'") at start."""
    out = _run(*module, "--log-level", "bogus", "--metrics-port", "-1")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert lines[-1].startswith(prog + "must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL"), lines
    assert lines[-1].endswith("got 'bogus'"), lines


@pytest.mark.parametrize("flag", ["--num-heads", "--num-kv-heads", "--hidden-size", "--num-layers"])
def test_make_tiny_model_refuses_zero_sizes(tmp_path: Path, flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_main(["make-tiny-model", str(tmp_path / "m"), flag, "0"]) == 2
    assert capsys.readouterr().err == f"kv-engine: error: sizes must be >= 1: {flag} 0\n"
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("module", [["offloadd"], ["bridge.main"], ["engine", "serve"], ["ingest"],
                                    ["router.main"]])
def test_help_says_what_and_shows_an_example(module: list[str]) -> None:
    out = _run(*module, "--help")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    text = " ".join(out.stdout.split())
    assert "example:" in text.lower(), text[-400:]
    assert "default" in text  # the defaults are told


@pytest.mark.parametrize("target, ok", [
    ("127.0.0.1:50051", True), ("[::1]:50051", True), ("offloadd:50051", True), ("unix:/run/kvd.sock", True),
    ("dns:///offloadd:50051", True), ("garbage::", False), ("h:port", False), (":50051", False),
    ("h:70000", False), ("::1:50051", False), ("h", False),
])
def test_grpc_targets_are_checked(target: str, ok: bool, model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A malformed --offloadd was retried forever, looking like a daemon that is down."""
    if ok:
        assert check_grpc_target(target, "--offloadd") == target
        return
    with pytest.raises(TargetError, match=f"^--offloadd {target!r}: "):
        check_grpc_target(target, "--offloadd")
    assert engine_main(["serve", "--model", str(model), "--offloadd", target, "--metrics-port", "-1"]) == 2
    assert capsys.readouterr().err.startswith(f"kv-engine: error: --offloadd {target!r}: ")
