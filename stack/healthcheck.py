"""Readiness probes used by the launcher and by compose healthchecks.

    python -m stack.healthcheck grpc HOST:PORT [SERVICE]   # grpc.health.v1 SERVING?
    python -m stack.healthcheck http URL                   # HTTP 200?
Exit 0 when healthy, 1 otherwise (with the reason on stderr).
"""

from __future__ import annotations

import sys
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def grpc_serving(target: str, service: str = "", timeout_s: float = 2.0) -> tuple[bool, str]:
    try:
        with grpc.insecure_channel(target) as channel:
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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[0] not in ("grpc", "http"):
        print(__doc__, file=sys.stderr)
        return 2
    if args[0] == "grpc":
        ok, why = grpc_serving(args[1], args[2] if len(args) > 2 else "")
    else:
        ok, why = http_ok(args[1])
    print(why, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
