"""Shared scaffolding of the gRPC workers (prefill, decode, colocated): the proto ↔ engine
conversions, the KV block source/loader bound to an engine, and server bootstrap with health,
reflection and graceful shutdown. Imports engine, kv_transfer and protos (like the services)."""
