"""Tracing and metrics hooks.

Traces: one trace per prompt group (docs/observability.md):

    controller.lease ─▶ rollout.group ─┬▶ rollout.generate (per turn: ttft, tokens, version, worker)
       (NATS header)                   ├▶ environment.step (per turn, over gRPC metadata)
                                       └▶ replay.ingest (NATS header)
                                          trainer.consume ◀─link─ trainer.step (the step that trained on it)

Context crosses NATS in message headers (services/common/bus.py injects them on every publish) and gRPC
in metadata: `channel()` clients carry a W3C traceparent on every call, and `run_service` servers make
it the current context while the handler runs. The trainer learns each group's trace from the
TrajectoryGroup's `traceparent`. With no OTLP endpoint configured, spans are still created (so
timings exist) but nothing is exported.

Metrics: every service serves Prometheus /metrics on `telemetry.metrics_port` when set.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import grpc
from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Link
from prometheus_client import start_http_server

from services.common.config import TelemetryConfig

EXPORT_DELAY_MS = 1000
"""How long finished spans wait before a batch export: short, so a trace appears while its step runs."""


def setup_telemetry(service: str, run: str, cfg: TelemetryConfig) -> trace.Tracer:
    provider = TracerProvider(resource=Resource.create({"service.name": f"flywheel-{service}", "flywheel.run": run}))
    if cfg.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=cfg.otlp_endpoint, insecure=True)
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS))
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


def current_traceparent() -> str:
    """The W3C traceparent of the current span; empty when there is none."""
    return inject_headers().get("traceparent", "")


def link_to(traceparent: str) -> Link | None:
    """A span link to the span a traceparent names; None for an empty or malformed one."""
    span_context = trace.get_current_span(extract_context({"traceparent": traceparent})).get_span_context()
    return Link(span_context) if span_context.is_valid else None


def shutdown_telemetry() -> None:
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()


# -- training steps --------------------------------------------------------------------------------------


def start_step_span(step: int, groups: Iterable, tracer: trace.Tracer | None = None) -> trace.Span:
    """The span of training step `step` (the caller ends it), linked to every consumed group's trace. Each
    group's own trace also gets a `trainer.consume` span, linked back, so a group's trace names its step."""
    tracer = tracer or trace.get_tracer("flywheel.trainer")
    groups = list(groups)
    links = [(g, link_to(g.traceparent)) for g in groups]
    step_span = tracer.start_span("trainer.step", links=[link for _, link in links if link], attributes={
        "flywheel.step": step, "flywheel.groups": len(groups)})
    back = [Link(step_span.get_span_context())]
    for group, link in links:
        if link is None:
            continue
        parent = trace.set_span_in_context(trace.NonRecordingSpan(link.context))
        tracer.start_span("trainer.consume", context=parent, links=back, attributes={
            "flywheel.step": step, "flywheel.group_id": group.group_id,
            "flywheel.staleness": step - group.version_start}).end()
    return step_span


# -- gRPC metadata ---------------------------------------------------------------------------------------


class ClientTraceInterceptor(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    """Client side: the caller's trace context travels as W3C `traceparent` metadata on every call."""

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        headers = inject_headers()
        if not headers:
            return details
        return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), *headers.items()))

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class ServerTraceInterceptor(grpc.aio.ServerInterceptor):
    """Server side: a unary handler runs with the caller's trace context current, so the spans it starts
    join the caller's trace. Calls without a traceparent are passed through untouched."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        metadata = {k: v for k, v in handler_call_details.invocation_metadata or () if isinstance(v, str)}
        if handler is None or handler.unary_unary is None or "traceparent" not in metadata:
            return handler
        parent, inner = extract_context(metadata), handler.unary_unary

        async def traced(request, servicer_context):
            token = context.attach(parent)
            try:
                return await inner(request, servicer_context)
            finally:
                context.detach(token)

        return grpc.unary_unary_rpc_method_handler(traced, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)
