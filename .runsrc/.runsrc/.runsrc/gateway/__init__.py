"""The public front door: OpenAI-compatible REST + gRPC `Gateway.Generate` (DESIGN.md §3).

The gateway tokenizes, routes, orchestrates prefill → decode over gRPC and streams text back.
It never imports torch: only `protos` and the torch-free tokenizer modules of `engine`.
"""
