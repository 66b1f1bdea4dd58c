"""OpenTelemetry tracing across the gateway and the workers: optional, no-op unless configured.

`setup_tracing` (called once at process start) installs an SDK tracer provider with an OTLP
exporter only when `OTEL_EXPORTER_OTLP_ENDPOINT` is set and `opentelemetry-exporter-otlp` is
installed; otherwise the API's no-op tracer stays in place and every span below is a
non-recording one (no allocation of attributes, nothing exported, no `traceparent` sent).

The W3C trace context crosses each gRPC hop in the call metadata (`traceparent`, lowercase as
gRPC requires). Spans are never made "current": the gateway's per-request span fans out to
concurrent tasks, and the decode span lives in an async generator whose frames may resume in
another context — so parents are passed explicitly as `Context` objects instead.

Torch-free and grpc-free: the gateway imports it; it imports only opentelemetry.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

if TYPE_CHECKING:
    from grpc.aio import ServicerContext
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger(__name__)

TRACER_NAME = "splitserve"
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
# The traces-only endpoint (a full URL); `--otlp-traces-endpoint` sets it, as vLLM's flag does.
TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
PROTOCOL_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")

Metadata = Iterable[tuple[str, str | bytes]]


def setup_tracing(service_name: str, provider: TracerProvider | None = None,
                  endpoint: str | None = None) -> bool:
    """Install the global tracer provider; returns True when spans will be recorded.

    With `provider` (tests: an SDK provider with an in-memory exporter) that provider is
    installed as is. Otherwise an OTLP-exporting provider named `service_name` is installed
    when an endpoint is given (`endpoint`, the `--otlp-traces-endpoint` flag) or set
    (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_ENDPOINT`) and the OTLP exporter
    (the `otlp` extra) is importable; if not, nothing is installed and tracing stays a no-op.
    OpenTelemetry accepts one global provider per process: a second call leaves the first in
    place (it logs a warning).
    """
    if endpoint:
        os.environ[TRACES_ENDPOINT_ENV] = endpoint  # the exporters read it
    if provider is None:
        provider = _otlp_provider(service_name)
        if provider is None:
            return False
    trace.set_tracer_provider(provider)
    return True


def _otlp_provider(service_name: str) -> TracerProvider | None:
    endpoint = os.environ.get(TRACES_ENDPOINT_ENV) or os.environ.get(ENDPOINT_ENV)
    if not endpoint:
        return None
    exporter_class = _exporter_class()
    if exporter_class is None:
        log.warning("an OTLP endpoint is set but opentelemetry-exporter-otlp is not installed "
                    "(pip install 'splitserve[otlp]'): tracing stays off")
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    provider.add_span_processor(BatchSpanProcessor(exporter_class()))  # endpoint from env
    log.info("tracing: exporting spans of %s over OTLP to %s", service_name, endpoint)
    return provider


def _exporter_class() -> type | None:
    """The OTLP span exporter of the protocol asked for (OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL:
    grpc, vLLM's default, or http/protobuf), None when the `otlp` extra is missing."""
    protocol = next((os.environ[e] for e in PROTOCOL_ENVS if os.environ.get(e)), "grpc")
    flavour = "http" if protocol.startswith("http") else "grpc"
    try:
        module = importlib.import_module(f"opentelemetry.exporter.otlp.proto.{flavour}."
                                         "trace_exporter")
    except ImportError:
        return None
    exporter: type = module.OTLPSpanExporter
    return exporter


def get_tracer() -> trace.Tracer:
    """The splitserve tracer of the global provider (a proxy until `setup_tracing` runs)."""
    return trace.get_tracer(TRACER_NAME)


def span_context(span: Span) -> Context:
    """A context whose current span is `span`: the parent argument for its children."""
    return trace.set_span_in_context(span)


def inject_metadata(parent: Context) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying `parent`'s span as W3C `traceparent` (empty when no-op)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=parent)
    return tuple((k.lower(), v) for k, v in carrier.items())


def extract_context(metadata: Metadata | None) -> Context:
    """The remote parent carried in gRPC metadata (`context.invocation_metadata()`); an empty
    context (a new root) when there is none."""
    return propagate.extract(metadata_carrier(metadata))


@contextlib.contextmanager
def remote_parent(carrier: Mapping[str, str]) -> Iterator[None]:
    """Within the block, the caller's span (W3C `traceparent` in `carrier`: HTTP headers or
    gRPC metadata, lowercase keys) is the current one, so spans started without an explicit
    parent (the gateway's request span) join the client's trace instead of opening one."""
    token = otel_context.attach(propagate.extract(carrier))
    try:
        yield
    finally:
        otel_context.detach(token)


def metadata_carrier(metadata: Metadata | None) -> dict[str, str]:
    """gRPC metadata as a propagation carrier (binary `-bin` entries never carry context)."""
    return {key.lower(): value for key, value in metadata or () if isinstance(value, str)}


def record_error(span: Span, message: str) -> None:
    """Mark `span` failed with `message` (an error the code handled, e.g. before an abort)."""
    span.set_status(Status(StatusCode.ERROR, message))


@contextlib.contextmanager
def traced_span(name: str, *, parent: Context | None, kind: SpanKind = SpanKind.INTERNAL,
                attributes: Mapping[str, AttributeValue] | None = None,
                passthrough: tuple[type[BaseException], ...] = ()) -> Iterator[Span]:
    """Start a span under `parent` (not made current) and end it on exit.

    An exception marks the span failed, except cancellation (recorded as an attribute: the
    client went away) and the `passthrough` types (already recorded, e.g. a gRPC abort after
    `record_error`).
    """
    span = get_tracer().start_span(name, context=parent, kind=kind, attributes=attributes)
    try:
        yield span
    except BaseException as e:
        if _is_cancellation(e):
            span.set_attribute("splitserve.cancelled", True)
        elif not isinstance(e, passthrough):
            span.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
        raise
    finally:
        span.end()


def server_span(name: str, context: ServicerContext, attributes: Mapping[str, AttributeValue]
                ) -> contextlib.AbstractContextManager[Span]:
    """A servicer's span for one call, under the caller's span (W3C traceparent in the call's
    metadata); the handler records its own aborts (`record_error`), which pass through."""
    from grpc.aio import AbortError

    return traced_span(name, parent=extract_context(context.invocation_metadata()),
                       kind=SpanKind.SERVER, attributes=attributes, passthrough=(AbortError,))


def _is_cancellation(e: BaseException) -> bool:
    import asyncio

    return isinstance(e, (asyncio.CancelledError, GeneratorExit))
