#!/usr/bin/env python3
"""gRPC health probe for Flywheel services (grpc_health_probe is not in the image).

    python deploy/health_probe.py HOST:PORT [SERVICE] [--wait SECONDS]

Asks the standard grpc.health.v1 Health service of a Flywheel server (every service registers
it in services/common/server.py: "" and "flywheel.v1.<name>"). Exit 0 when the answer is
SERVING, 1 otherwise. With --wait it retries until SERVING or the deadline (the Slurm launcher
uses this to wait for the infra node); without it, one attempt (compose health checks).
Only grpcio and grpcio-health-checking are needed: both are in the light base install.
"""

from __future__ import annotations

import argparse
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str, timeout_s: float) -> str:
    """The serving status name, or the gRPC error code name when the call fails."""
    with grpc.insecure_channel(address) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as err:
            return err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("address", help="host:port of the service's gRPC server")
    p.add_argument("service", nargs="?", default="", help='health service name, e.g. flywheel.v1.replay ("" = server)')
    p.add_argument("--timeout", type=float, default=3.0, help="seconds per attempt")
    p.add_argument("--wait", type=float, default=0.0, help="retry until SERVING for this many seconds")
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.wait
    while True:
        status = check(args.address, args.service, args.timeout)
        if status == "SERVING":
            return 0
        if time.monotonic() >= deadline:
            print(f"{args.address} {args.service or '<server>'}: {status}", file=sys.stderr)
            return 1
        time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main())
