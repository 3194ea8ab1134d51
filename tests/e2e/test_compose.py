"""compose.yaml checked statically (in the default suite, with no Docker daemon; tests/compose
builds the images and runs it for real): against the Compose specification's
JSON schema (compose_spec/, vendored with its licence), every reference between services, every
command and environment variable parsed by the real parsers of our processes, ports consistent
with their defaults, and model-init's script run for real. What the image installs is checked by
tests/packaging/test_wheel.py."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from bridge.config import BridgeConfig, config_from_args
from engine.__main__ import _parser as engine_parser
from offloadd.config import OffloaddConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = Path(__file__).resolve().parent / "compose_spec" / "compose-spec.json"
TOP_KEYS = {"name", "services", "volumes", "networks", "configs", "secrets"}
SERVICE_KEYS = {
    "build", "image", "command", "entrypoint", "environment", "env_file", "ports", "expose",
    "volumes", "depends_on", "healthcheck", "restart", "ipc", "shm_size", "profiles", "deploy",
    "user", "networks", "labels", "ulimits", "working_dir", "stop_grace_period", "stop_signal",
}
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


def _interpolate(value: str) -> str:
    """Compose's ${VAR:-default} with nothing set: the default."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "compose.yaml").read_text())
    assert isinstance(data, dict)
    return data


def _services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    services = compose["services"]
    assert isinstance(services, dict)
    return services


def _env(service: dict[str, Any]) -> dict[str, str]:
    return {k: _interpolate(str(v)) for k, v in service.get("environment", {}).items()}


def _published(service: dict[str, Any]) -> set[int]:
    out = set()
    for p in service.get("ports", []):
        host, container = str(p).split(":")
        assert host == container, f"{p}: publish on the same port"
        out.add(int(container))
    return out


def _interpolated(node: Any) -> Any:
    if isinstance(node, str):
        return _interpolate(node)
    if isinstance(node, list):
        return [_interpolated(v) for v in node]
    if isinstance(node, dict):
        return {k: _interpolated(v) for k, v in node.items()}
    return node


def test_valid_against_the_compose_spec_schema(compose: dict[str, Any]) -> None:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    validator = jsonschema.Draft7Validator(schema)
    for doc in (compose, _interpolated(compose)):  # as written, and as Compose sees it with nothing set
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
        assert not errors, errors


def test_the_schema_rejects_what_compose_rejects(compose: dict[str, Any]) -> None:
    """The schema is really applied: a misspelt key and a wrong type fail."""
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    bad = json.loads(json.dumps(compose))
    bad["services"]["engine"]["helthcheck"] = bad["services"]["engine"].pop("healthcheck")
    bad["services"]["redis"]["ports"] = "6379:6379"
    assert {e.validator for e in validator.iter_errors(bad)} >= {"additionalProperties", "type"}


def test_shape_follows_the_compose_spec(compose: dict[str, Any]) -> None:
    assert set(k for k in compose if not k.startswith("x-")) <= TOP_KEYS
    services = _services(compose)
    assert {"redis", "offloadd", "kv-bridge", "engine"} <= set(services)
    for name, svc in services.items():
        unknown = set(svc) - SERVICE_KEYS
        assert not unknown, f"{name}: keys not in the Compose spec: {unknown}"
        assert "image" in svc or "build" in svc, name
        hc = svc.get("healthcheck")
        if hc is not None:
            assert hc["test"][0] in ("CMD", "CMD-SHELL"), name
    assert services["engine-gpu"]["profiles"] == ["gpu"]
    gpu = services["engine-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]


def test_references_resolve(compose: dict[str, Any]) -> None:
    services = _services(compose)
    volumes = set(compose.get("volumes", {}))
    for name, svc in services.items():
        for dep, spec in svc.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert spec["condition"] in CONDITIONS
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{dep} has no healthcheck"
        for v in svc.get("volumes", []):
            src = str(v).split(":")[0]
            assert src in volumes, f"{name}: volume {src} not declared"
        ipc = svc.get("ipc")
        if ipc and ipc.startswith("service:"):
            owner = ipc.split(":", 1)[1]
            assert services[owner]["ipc"] == "shareable", f"{owner} must share its IPC namespace"
            assert services[owner].get("shm_size"), f"{owner} needs room in /dev/shm for the arena"


def test_commands_exist_in_the_project(compose: dict[str, Any]) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name, svc in _services(compose).items():
        if "build" not in svc:
            continue
        cmd = svc["command"]
        if cmd[0] == "python":
            # python -m MODULE: a module of the project (tests/packaging runs it in the image)
            assert cmd[1] == "-m", f"{name}: {cmd}"
            path = ROOT / cmd[2].replace(".", "/")
            assert path.with_suffix(".py").is_file() or (path / "__main__.py").is_file(), (
                f"{name}: {cmd[2]} is not a module of the project"
            )
        else:
            assert cmd[0] in scripts or cmd[0] == "sh", f"{name}: {cmd[0]} is not a console script"
        health = svc.get("healthcheck", {}).get("test", [])
        if "stack.healthcheck" in health:
            assert (ROOT / "stack" / "healthcheck.py").exists()
    dockerfile = (ROOT / "Dockerfile").read_text()
    for src in ("proto", *_packages()):
        assert f"COPY {src} ./{src}" in dockerfile, f"the image lacks {src}"
    assert "torch==2.13.0" in dockerfile


def _packages() -> list[str]:
    """Top-level packages setuptools finds at the root (the wheel's, less kvcache under proto/)."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    names = {p.rstrip("*") for p in find["include"]}
    found = sorted(d.name for d in ROOT.iterdir() if d.name in names and (d / "__init__.py").is_file())
    assert {"events", "bridge", "kvctl", "engine", "offloadd", "rpc", "stack"} <= set(found)
    return found


def _model_init_script(compose: dict[str, Any], models: Path) -> str:
    svc = _services(compose)["model-init"]
    cmd = svc["command"]
    assert cmd[:2] == ["sh", "-c"] and svc["user"] == "root"
    assert "models:/models" in svc["volumes"]
    script: str = cmd[2]
    return script.replace("/models/", f"{models}/")


def _world_readable(root: Path) -> list[str]:
    """Paths under root that uid 1000 (neither owner nor group) could not read."""
    bad = []
    for path in [root, *root.rglob("*")]:
        mode = path.stat().st_mode
        need = stat.S_IROTH | (stat.S_IXOTH if path.is_dir() else 0)
        if mode & need != need:
            bad.append(f"{path.relative_to(root)} {stat.filemode(mode)}")
    return bad


def _run_model_init(script: str) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    # umask 077: the worst a container runtime may hand model-init
    res = subprocess.run(["sh", "-c", f"umask 077; {script}"], env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr


def test_model_init_leaves_the_model_readable_by_the_engine(compose: dict[str, Any], tmp_path: Path) -> None:
    """The engine runs as uid 1000 and model-init as root: its script, run here for real, must
    leave every file world-readable, both when it writes the model and over a volume an older
    model-init filled with 0600 files."""
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    _run_model_init(_model_init_script(compose, fresh))
    assert (fresh / "model" / "config.json").is_file()
    assert not _world_readable(fresh / "model")

    old = tmp_path / "old"
    (old / "model" / "sub").mkdir(parents=True)
    for f in ("config.json", "model.safetensors", "sub/tokenizer.json"):
        (old / "model" / f).write_text("{}")
        (old / "model" / f).chmod(0o600)
    (old / "model" / "sub").chmod(0o700)
    (old / "model").chmod(0o700)
    _run_model_init(_model_init_script(compose, old))
    assert not _world_readable(old / "model")
    assert (old / "model" / "config.json").read_text() == "{}"  # kept, not rewritten


def test_offloadd_config_parses_and_ports_match(compose: dict[str, Any]) -> None:
    svc = _services(compose)["offloadd"]
    cfg = load_config(svc["command"][1:], _env(svc))
    assert cfg.grpc_port == OffloaddConfig().grpc_port == 50051
    assert cfg.metrics_port == OffloaddConfig().metrics_port
    assert _published(svc) == {cfg.grpc_port, cfg.metrics_port}
    assert cfg.redis_url.startswith("redis://redis:")
    assert f"localhost:{cfg.grpc_port}" in svc["healthcheck"]["test"]


def test_bridge_config_parses_and_ports_match(compose: dict[str, Any]) -> None:
    svc = _services(compose)["kv-bridge"]
    cfg = config_from_args(svc["command"][1:], _env(svc))
    default = BridgeConfig()
    ports = {int(e.rsplit(":", 1)[1]) for e in (cfg.pub_endpoint, cfg.replay_endpoint)}
    assert ports == {int(e.rsplit(":", 1)[1]) for e in (default.pub_endpoint, default.replay_endpoint)}
    assert cfg.metrics_port == default.metrics_port
    assert _published(svc) == ports | {cfg.metrics_port}
    assert f"http://localhost:{cfg.metrics_port}/healthz" in svc["healthcheck"]["test"]


@pytest.mark.parametrize("name", ["engine", "engine-gpu"])
def test_engine_command_parses_and_ports_match(compose: dict[str, Any], name: str) -> None:
    svc = _services(compose)[name]
    args = engine_parser().parse_args([_interpolate(a) for a in svc["command"][1:]])
    assert args.command == "serve"
    assert args.offloadd == "offloadd:50051" and args.offload
    assert _published(svc) == {args.port, args.metrics_port}
    assert f"localhost:{args.port}" in svc["healthcheck"]["test"]
    assert svc["ipc"] == "service:offloadd"
    if name == "engine":
        assert args.port == engine_parser().parse_args(["serve", "--model=m"]).port
