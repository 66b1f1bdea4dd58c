"""The public front door: OpenAI-compatible REST + gRPC `Gateway.Generate` (docs/architecture.md, "A request's way through the layers").

The gateway tokenizes, routes, orchestrates prefill → decode over gRPC and streams text back.
It never imports torch: only `protos`, `rpc` and the torch-free `engine_api` (tokenizer,
detokenizer, chat templates, hashing, params); never `engine`, `worker` or `kv_transfer`.
"""
