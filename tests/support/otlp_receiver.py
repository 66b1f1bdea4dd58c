"""A real OTLP/gRPC trace receiver on 127.0.0.1: the protocol's own `TraceService.Export`
(opentelemetry-proto's service definition, as a collector serves it), keeping what it received
so a test can read the spans an exporter sent over the wire."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self._receiver = receiver

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
               context: Any) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._receiver.lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self._receiver.spans.append((attrs.get("service.name", ""), span))
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """`with OtlpReceiver() as r:` serves on `r.endpoint` (http://127.0.0.1:PORT)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[tuple[str, trace_pb2.Span]] = []  # (service.name, span)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2),
                                   options=[("grpc.so_reuseport", 0)])
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self),
                                                                  self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)

    def wait_for(self, name: str, timeout_s: float = 20.0) -> list[tuple[str, trace_pb2.Span]]:
        """The received spans named `name`, once there is one (empty after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                found = [(svc, s) for svc, s in self.spans if s.name == name]
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.05)
