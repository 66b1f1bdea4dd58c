"""Decode role: pulls a prompt's KV from a prefill worker and decodes with continuous batching."""
