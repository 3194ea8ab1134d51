"""compose.yaml's kv-router, checked statically with the router's own parser: every engine it
names is a service serving HTTP on that port, its bridge endpoints are kv-bridge's, and its
published port is the one it serves and probes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from engine.__main__ import _parser as engine_parser
from router.main import _parser as router_parser
from router.main import config_from_args

ROOT = Path(__file__).resolve().parents[2]


def _interpolate(value: str) -> str:
    """``${VAR:-default}`` -> default (what compose does with the variable unset)."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)


def _services() -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    return services


def test_router_service_reaches_the_engines_and_the_bridge(tmp_path: Path) -> None:
    services = _services()
    svc = services["kv-router"]
    args = router_parser().parse_args([_interpolate(a) for a in svc["command"][1:]])
    model, args.model = args.model, str(tmp_path)  # the volume's path exists only in the container
    config = config_from_args(args)
    assert config.policy == "kv" and len(config.engines) == 2
    for spec in config.engines:
        host = urlsplit(spec.url)
        engine = services[host.hostname]
        engine_args = engine_parser().parse_args([_interpolate(a) for a in engine["command"][1:]])
        assert engine_args.http_port == host.port, spec
        assert spec.grpc == f"{host.hostname}:{engine_args.port}"
        assert engine_args.engine_id == spec.source, "the router must know the engine's log source"
        assert engine_args.served_model_name == config.served_model_name
        assert engine_args.model == model, "the router tokenizes with the engines' model"
        assert svc["depends_on"][host.hostname]["condition"] == "service_healthy"
    bridge_env = services["kv-bridge"]["environment"]
    for endpoint, published in ((config.bridge_pub, bridge_env["KVB_PUB"]), (config.bridge_replay, bridge_env["KVB_REPLAY"])):
        assert urlsplit(endpoint).hostname == "kv-bridge" and urlsplit(endpoint).port == urlsplit(published).port
    assert config.topic == _interpolate(bridge_env["KVB_TOPIC"])
    assert svc["ports"] == [f"{config.port}:{config.port}", f"{config.grpc_port}:{config.grpc_port}"]
    assert f"http://localhost:{config.port}/health" in svc["healthcheck"]["test"]
