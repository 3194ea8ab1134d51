"""Readiness probes used by the launcher and by compose healthchecks.

    python -m stack.healthcheck grpc HOST:PORT [SERVICE] [--ca PEM [--cert PEM --key PEM]]
    python -m stack.healthcheck http URL                   # HTTP 200?
grpc: grpc.health.v1 SERVING? Health needs no bearer token (SECURITY.md); --ca probes a TLS
port, --cert/--key present a client certificate where mutual TLS is on.
Exit 0 when healthy, 1 otherwise (with the reason on stderr), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import sys
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rpc.tls import ClientSecurity, SecurityConfigError


def grpc_serving(target: str, service: str = "", timeout_s: float = 2.0,
                 security: ClientSecurity | None = None) -> tuple[bool, str]:
    try:
        with (security or ClientSecurity()).channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError as exc:
        return False, f"{target}: {exc.code().name}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{target}: {status}"


def http_ok(url: str, timeout_s: float = 2.0) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200, f"{url}: HTTP {resp.status}"
    except OSError as exc:
        return False, f"{url}: {exc}"


class _Usage(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _Usage(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="stack.healthcheck", add_help=False)
    p.add_argument("kind", choices=["grpc", "http"])
    p.add_argument("target")
    p.add_argument("service", nargs="?", default="")
    p.add_argument("--ca", default="")
    p.add_argument("--cert", default="")
    p.add_argument("--key", default="")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        a = _parser().parse_args(sys.argv[1:] if argv is None else argv)
        security = ClientSecurity.from_files(a.ca, a.cert, a.key)
    except (_Usage, SecurityConfigError) as exc:
        print(f"{exc}\n{__doc__}", file=sys.stderr)
        return 2
    if a.kind == "grpc":
        ok, why = grpc_serving(a.target, a.service, security=security)
    else:
        ok, why = http_ok(a.target)
    print(why, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
