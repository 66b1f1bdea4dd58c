"""Benchmark CLI and workloads; metrics named as in `vllm bench serve` (docs/performance.md).

Modules: `metrics` (per-request records → throughput/latency/goodput), `workloads` (random and
shared-prefix prompts, Poisson/gamma arrivals), `online` (streaming client against the
gateway's `/v1/completions`), `offline` (engine in-process), `hf_baseline` (`transformers`
reference), `results` (JSON writer), `cli` (`splitserve bench ...`).
"""
