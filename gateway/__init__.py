"""The public front door: OpenAI-compatible REST + gRPC `Gateway.Generate` (docs/architecture.md, "A request's way through the layers").

The gateway tokenizes, routes, orchestrates prefill → decode over gRPC and streams text back.
It never imports torch: only `protos` and the torch-free tokenizer modules of `engine`.
"""
