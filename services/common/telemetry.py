"""Tracing and metrics hooks.

Traces: one trace per prompt group, from the controller's lease through rollout, the
environment, replay ingest and the training step. Context crosses NATS in message headers
and gRPC in metadata (W3C traceparent). With no OTLP endpoint configured, spans are still
created (so timings exist) but nothing is exported.

Metrics: every service serves Prometheus /metrics on `telemetry.metrics_port` when set.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from prometheus_client import start_http_server

from services.common.config import TelemetryConfig


def setup_telemetry(service: str, run: str, cfg: TelemetryConfig) -> trace.Tracer:
    provider = TracerProvider(resource=Resource.create({"service.name": f"flywheel-{service}", "flywheel.run": run}))
    if cfg.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=cfg.otlp_endpoint, insecure=True)))
    trace.set_tracer_provider(provider)
    if cfg.metrics_port:
        start_http_server(cfg.metrics_port, addr=cfg.metrics_host)
    return trace.get_tracer(f"flywheel.{service}")


def inject_headers() -> dict[str, str]:
    """Current trace context as headers for a NATS message or gRPC metadata."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def extract_context(headers: Mapping[str, str] | None) -> context.Context:
    return propagate.extract(dict(headers or {}))


def shutdown_telemetry() -> None:
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()
