"""gRPC plumbing shared by every service, torch-free: the cluster credential (auth), TLS,
channels, message-size limits, the embedding wire format and OpenTelemetry tracing. The
generated message and stub code lives in `protos/`."""
