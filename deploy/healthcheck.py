#!/usr/bin/env python3
"""Container health check: is the episerve daemon SERVING (gRPC ``grpc.health.v1``)?

    episerve-healthcheck            exit 0 when serving, 1 otherwise

It reads the daemon's own ``EPISERVE_*`` variables to find it, in this order:
- ``EPISERVE_HEALTH_PORT``: the plaintext health port (required when TLS is on);
- ``EPISERVE_UNIX``: the unix socket;
- ``EPISERVE_PORT`` (default 50051) on ``EPISERVE_HOST`` (a wildcard host means loopback).
Health stays open when the daemon requires a token, so no secret is needed here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = 3.0
WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}


class ProbeError(Exception):
    pass


def target(env: Mapping[str, str]) -> str:
    """The address to probe, from the daemon's settings."""
    host = env.get("EPISERVE_HOST", "127.0.0.1").strip()
    if host in WILDCARD_HOSTS:
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    health_port = env.get("EPISERVE_HEALTH_PORT", "").strip()
    if health_port not in ("", "0"):
        return f"{host}:{health_port}"
    if env.get("EPISERVE_TLS_CERT", "").strip():
        raise ProbeError("TLS is on: set EPISERVE_HEALTH_PORT so probes can speak plaintext")
    unix = env.get("EPISERVE_UNIX", "").strip()
    if unix:
        return f"unix:{unix}"
    return f"{host}:{env.get('EPISERVE_PORT', '50051').strip() or '50051'}"


def check(address: str, timeout_s: float = TIMEOUT_S) -> str:
    """The daemon's overall health status name, e.g. ``SERVING``."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def main(env: Mapping[str, str] = os.environ) -> int:
    try:
        address = target(env)
        status = check(address)
    except ProbeError as exc:
        print(f"episerve-healthcheck: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
        print(f"episerve-healthcheck: {address}: {code.name}", file=sys.stderr)
        return 1
    if status != "SERVING":
        print(f"episerve-healthcheck: {address} is {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
