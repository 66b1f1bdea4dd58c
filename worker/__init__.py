"""What the prefill and decode services share: the worker server bootstrap, request conversion
from protobuf, engine-bound servicer helpers, the KV-serving glue and the CPU/Redis tier cache.
A library: no entry point, no role of its own, no gateway import."""
