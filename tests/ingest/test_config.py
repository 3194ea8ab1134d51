"""kv-ingest's flags, spec strings and config file; errors are one line, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ingest.config import VllmSource, config_from_args, parse_spec
from ingest.errors import IngestConfigError

REPO = Path(__file__).resolve().parents[2]


def test_a_spec_expands_data_parallel_ranks_onto_vllms_ports() -> None:
    assert parse_spec("pod=tcp://10.0.0.7:5557,replay=tcp://10.0.0.7:6000,topic=kv,dp=3") == [
        VllmSource("pod", "tcp://10.0.0.7:5557", "tcp://10.0.0.7:6000", "kv", 0),
        VllmSource("pod", "tcp://10.0.0.7:5558", "tcp://10.0.0.7:6001", "kv", 1),
        VllmSource("pod", "tcp://10.0.0.7:5559", "tcp://10.0.0.7:6002", "kv", 2),
    ]
    assert parse_spec("a=tcp://h:1") == [VllmSource("a", "tcp://h:1")]


@pytest.mark.parametrize(("spec", "message"), [
    ("tcp://h:1", "expected NAME="),
    ("a=http://h:1", "ZMQ endpoint"),
    ("a=tcp://h:1,replay=tcp://h:2,replay=tcp://h:3", "repeated option"),
    ("a=tcp://h:1,color=red", "unknown or repeated option"),
    ("a=tcp://h:1,dp=zero", "dp must be an integer"),
    ("a=tcp://h:1,dp=0", "dp must be in"),
    ("a b=tcp://h:1", "bad publisher name"),
])
def test_bad_specs_are_refused_with_a_reason(spec: str, message: str) -> None:
    with pytest.raises(IngestConfigError, match=message):
        parse_spec(spec)


def test_config_file_and_flags_together(tmp_path: Path) -> None:
    path = tmp_path / "ingest.toml"
    path.write_text('[[vllm]]\nname = "b"\npub = "tcp://h:7000"\nreplay = "tcp://h:7100"\ndp = 2\n')
    config = config_from_args(["--vllm", "a=tcp://h:1", "--config", str(path)], {})
    assert [(s.name, s.pub, s.dp_rank) for s in config.sources] == [
        ("a", "tcp://h:1", 0), ("b", "tcp://h:7000", 0), ("b", "tcp://h:7001", 1)]
    env = config_from_args([], {"KVI_VLLM": "x=tcp://h:1;y=tcp://h:2", "KVI_IDLE_SYNC_S": "0.5"})
    assert [s.name for s in env.sources] == ["x", "y"] and env.idle_sync_s == 0.5
    path.write_text("[[vllm]]\nname = 3\n")
    with pytest.raises(IngestConfigError, match="needs string keys name and pub"):
        config_from_args(["--config", str(path)], {})
    with pytest.raises(IngestConfigError, match="unique"):
        config_from_args(["--vllm", "a=tcp://h:1", "--vllm", "a=tcp://h:2"], {})


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ingest", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=60)


def test_cli_help_and_errors_without_traceback(tmp_path: Path) -> None:
    helped = _cli("--help")
    assert helped.returncode == 0 and "--vllm" in helped.stdout and "replay=" in helped.stdout
    for args, message in [((), "no vLLM publisher given"),
                          (("--vllm", "a=tcp://h:1", "--config", str(tmp_path / "nope.toml")), "config file"),
                          (("--vllm", "a=tcp://h:1", "--offloadd-token-file", str(tmp_path / "t")), "token"),
                          (("--vllm", "a=tcp://h:1,replay=tcp://h"), "cannot connect to 'tcp://h'"),
                          (("--vllm", "a=tcp://h:1", "--offloadd", "h::"), "--offloadd 'h::': expected HOST:PORT")]:
        done = _cli(*args)
        assert done.returncode == 2, done.stderr
        assert message in done.stderr and "Traceback" not in done.stderr
    # each bad number names its flag and value (was one message naming three or two settings)
    for flag, value, message in [("--metrics-port", "99999", "must be in 0..65535, got 99999"),
                                 ("--max-pending", "0", "must be >= 1, got 0"),
                                 ("--idle-sync-s", "0", "must be > 0, got 0.0"),
                                 ("--publisher-lease-s", "nan", "must be > 0, got nan"),
                                 ("--replay-timeout-s", "-1", "must be > 0, got -1.0")]:
        with pytest.raises(IngestConfigError, match=f"^{flag} {message}$"):
            config_from_args(["--vllm", "a=tcp://h:1", flag, value], {})
    for var, value, kind in [("KVI_MAX_PENDING", "x", "an integer"), ("KVI_IDLE_SYNC_S", "soon", "a number")]:
        with pytest.raises(IngestConfigError, match=f"^bad environment value: {var}='{value}' is not {kind}$"):
            config_from_args(["--vllm", "a=tcp://h:1"], {var: value})


def test_the_compose_profile_runs_kv_ingest_with_flags_it_parses() -> None:
    import yaml

    services = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    ingest, demo = services["kv-ingest"], services["vllm-demo"]
    assert ingest["profiles"] == demo["profiles"] == ["vllm"]
    config = config_from_args(ingest["command"][1:], {})
    (source,) = config.sources
    assert (source.name, source.pub, source.replay) == (
        "vllm-demo", "tcp://vllm-demo:5567", "tcp://vllm-demo:5568")
    assert config.offloadd == "offloadd:50051"
    assert ingest["ports"] == [f"{config.metrics_port}:{config.metrics_port}"]
    assert f"localhost:{config.metrics_port}/healthz" in " ".join(ingest["healthcheck"]["test"])
    assert demo["command"] == [
        "python", "-m", "ingest.demo_engine", "--pub=tcp://*:5567", "--replay=tcp://*:5568"]
