"""An OTLP/gRPC trace receiver, started in the test: what an OpenTelemetry collector would get.

It is the TraceService of the OTLP protocol, from opentelemetry-proto's generated stubs (which come
with opentelemetry-exporter-otlp-proto-grpc), and keeps every span it is sent.
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from services.common.infra import free_port


@dataclass(kw_only=True, slots=True)
class ReceivedSpan:
    service: str
    """The exporting process's service.name resource attribute, e.g. flywheel-rollout."""
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    """Empty for a root span."""
    attributes: dict = field(default_factory=dict)
    links: list[tuple[str, str]] = field(default_factory=list)
    """(trace_id, span_id) of each linked span."""


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        received = []
        for resource_spans in request.resource_spans:
            service = {a.key: _value(a.value) for a in resource_spans.resource.attributes}.get("service.name", "")
            for scope in resource_spans.scope_spans:
                received += [ReceivedSpan(
                    service=service, name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent_id=s.parent_span_id.hex(), attributes={a.key: _value(a.value) for a in s.attributes},
                    links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links]) for s in scope.spans]
        with self.lock:
            self.spans += received
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)


@pytest.fixture(scope="module")
def otlp_receiver():
    """(receiver, "127.0.0.1:PORT") for telemetry.otlp_endpoint."""
    receiver = TraceReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield receiver, f"127.0.0.1:{port}"
    server.stop(grace=1)
